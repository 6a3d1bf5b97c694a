"""Incidents and thresholds through the real API: a real coordinator process, real agent
streams over gRPC, the CLI, SIGHUP, and the incidents surviving a coordinator restart."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import grpc
import pytest
from helpers import Cluster, Coordinator, run_cli, samples_named, scrape, wait_for
from training_builders import EXITED, AgentStream, poll_until, rank_report, step

from clusterwatch.v1 import cluster_pb2, training_pb2

pytestmark = pytest.mark.timeout(60)

ACKNOWLEDGED = cluster_pb2.IncidentState.INCIDENT_STATE_ACKNOWLEDGED
RESOLVED = cluster_pb2.IncidentState.INCIDENT_STATE_RESOLVED
STEPS = [step(n) for n in range(1, 6)]


def live(coordinator: Coordinator) -> list[cluster_pb2.Incident]:
    with coordinator.client() as client:
        return client.incidents()


async def report_a_killed_rank(coordinator: Coordinator) -> cluster_pb2.Incident:
    """Two ranks on node-a; rank 1 dies by SIGKILL; wait for the failure incident."""
    async with AgentStream(coordinator.address, "node-a") as node:
        await node.report(rank_report(0, steps=STEPS), rank_report(1, steps=STEPS))
        killed = training_pb2.RankExit(
            timestamp_unix_seconds=1.0, signal=9, description="killed by signal 9 (SIGKILL)"
        )
        await node.report(rank_report(1, state=EXITED, exit=killed))

        def failure() -> cluster_pb2.Incident | None:
            return next((i for i in live(coordinator) if i.kind == "rank_failure"), None)

        found: cluster_pb2.Incident = await poll_until(failure, 20, "a rank_failure incident")
        return found


async def test_incidents_are_listed_acknowledged_resolved_and_counted(cluster: Cluster) -> None:
    coordinator = cluster.coordinator("--opt-out-jobs", "train")  # recovery leaves the incident's state alone
    incident = await report_a_killed_rank(coordinator)
    assert (incident.job, list(incident.ranks), list(incident.nodes)) == ("train", [1], ["node-a"])
    assert incident.state == cluster_pb2.IncidentState.INCIDENT_STATE_OPEN
    assert incident.evidence["signal"] == 9
    assert incident.opened_unix_seconds > 0
    snapshot = coordinator.snapshot()
    assert [i.id for i in snapshot.incidents] == [incident.id]

    metrics = scrape(coordinator.metrics_url)
    opened = samples_named(metrics, "clusterwatch_incidents_open", kind="rank_failure", severity="critical")
    assert [s.value for s in opened] == [1.0]
    (info,) = samples_named(metrics, "clusterwatch_incident_info", incident=incident.id)
    assert info.labels | {"incident": ""} == {
        "incident": "",
        "kind": "rank_failure",
        "severity": "critical",
        "state": "open",
        "training_job": "train",
        "ranks": "1",
        "nodes": "node-a",
        "gpus": info.labels["gpus"],
        "cause": incident.cause,
    }
    assert [
        s.value for s in samples_named(metrics, "clusterwatch_rank_failures_total", training_job="train")
    ] == [1.0]

    shown = run_cli("incidents", "--coordinator", coordinator.address).stdout
    assert incident.id in shown
    assert "rank 1 on node-a killed by signal 9 (SIGKILL)" in shown
    acked = json.loads(
        run_cli(
            "incidents", "--acknowledge", incident.id, "--json", "--coordinator", coordinator.address
        ).stdout
    )
    assert acked["state"] == "acknowledged"

    with coordinator.client() as client:
        with pytest.raises(grpc.RpcError) as bad_state:
            client.update_incident(incident.id, cluster_pb2.IncidentState.INCIDENT_STATE_OPEN)
        assert bad_state.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as unknown:
            client.update_incident("nope", RESOLVED)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        resolved = client.update_incident(incident.id, RESOLVED)
        assert resolved.resolved_unix_seconds > 0
        with pytest.raises(grpc.RpcError) as twice:
            client.update_incident(incident.id, ACKNOWLEDGED)
        assert twice.value.code() == grpc.StatusCode.NOT_FOUND
        # (node-a's stream has ended: on a slow machine its node_unreachable incident may be open by now.)
        assert [i for i in client.incidents() if i.kind == "rank_failure"] == []
        assert [i.state for i in client.incidents(include_resolved=True) if i.id == incident.id] == [RESOLVED]
    failed = run_cli("incidents", "--resolve", incident.id, "--coordinator", coordinator.address)
    assert failed.returncode == 1
    assert "NOT_FOUND" in failed.stderr


async def test_live_incidents_survive_a_coordinator_restart(cluster: Cluster) -> None:
    first = cluster.coordinator()
    incident = await report_a_killed_rank(first)
    first.stop()
    second = cluster.coordinator(grpc_port=first.grpc_port)
    assert [i.id for i in live(second)] == [incident.id]


def settings(coordinator: Coordinator, **changes: str) -> dict[str, str]:
    with coordinator.client() as client:
        return client.detection_settings(changes)


def test_thresholds_change_at_run_time_by_api_and_by_sighup(cluster: Cluster, tmp_path: Path) -> None:
    config = tmp_path / "clusterwatch.toml"
    config.write_text("[detection]\nhang_floor_s = 7.0\n")
    coordinator = cluster.coordinator("--config", str(config))
    assert settings(coordinator)["hang_floor_s"] == "7.0"
    assert settings(coordinator, straggler_threshold_ratio="0.1")["straggler_threshold_ratio"] == "0.1"
    for bad, says in (
        ({"straggler_threshold_ratio": "-1"}, "detection.straggler_threshold_ratio"),
        ({"no_such": "1"}, "detection.no_such"),
    ):
        with pytest.raises(grpc.RpcError) as rejected:
            settings(coordinator, **bad)
        assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in (rejected.value.details() or "")
    assert settings(coordinator)["straggler_threshold_ratio"] == "0.1"  # the bad calls changed nothing

    config.write_text("[detection]\nhang_floor_s = 9.5\n")
    coordinator.signal(signal.SIGHUP)
    wait_for(lambda: settings(coordinator)["hang_floor_s"] == "9.5", 20, "the reloaded hang floor")
    config.write_text("[detection]\nhang_floor_s = -3\n")
    coordinator.signal(signal.SIGHUP)
    wait_for(lambda: "kept the detection settings in force" in coordinator.log(), 20, "the rejected reload")
    assert "detection.hang_floor_s" in coordinator.log()
    assert settings(coordinator)["hang_floor_s"] == "9.5"


def test_a_bad_detection_setting_at_start_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = run_cli("coordinator", "--state-dir", str(tmp_path), "--straggler-window-steps", "1")
    assert result.returncode == 2
    assert "detection.straggler_window_steps" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
