"""Detection on real torchrun jobs (gloo) -> real agent -> real coordinator.

A rank is stopped, slowed or killed from outside, the way it happens in
production (a debugger, a throttled GPU, the OOM killer), and the
coordinator must open the right incident naming that rank. Latency is the
benchmark's business (bench/detection.py); these tests wait on conditions.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from helpers import (
    HOOK_WORKERS,
    Cluster,
    Coordinator,
    incident_of,
    incidents,
    ranks_of,
    run_cli,
    samples_named,
    scrape,
    stopped_rank_hang,
    wait_for,
    wait_for_ranks_past,
)

from clusterwatch.v1 import cluster_pb2, training_pb2

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

TRAIN = HOOK_WORKERS / "train_ddp.py"
RESOLVED = cluster_pb2.IncidentState.INCIDENT_STATE_RESOLVED
EXITED = training_pb2.RankState.RANK_STATE_EXITED


def start(cluster: Cluster, *detection: str) -> tuple[Coordinator, Path]:
    # Detection only: the recovery policy would restart a hung job (tests/e2e/test_recovery_e2e.py).
    coordinator = cluster.coordinator("--hang-action", "alert", *detection)
    cluster.agent(coordinator, "node-a")
    socket = cluster.socket_path("node-a")
    wait_for(socket.exists, 30, "the agent's hook socket")
    return coordinator, socket


def test_a_stopped_rank_is_a_hang_naming_it_with_a_healthy_ranks_stack(
    cluster: Cluster, tmp_path: Path
) -> None:
    coordinator, socket = start(cluster)
    until = tmp_path / "stop"
    job = cluster.torchrun(
        TRAIN,
        "--out-dir",
        str(tmp_path / "out"),
        "--job",
        "stopped",
        "--until-file",
        str(until),
        "--compute-ms",
        "20",
        nproc=2,
        socket=socket,
    )
    wait_for_ranks_past(coordinator, "stopped", 2, 10, 120)
    victim = ranks_of(coordinator, "stopped")[1].identity.pid
    stopped_at_unix_s = time.time()
    hang = stopped_rank_hang(coordinator, victim, rank=1, world_size=2)
    print(f"hang incident opened {hang.opened_unix_seconds - stopped_at_unix_s:.1f} s after SIGSTOP")
    assert list(hang.ranks) == [1]
    assert hang.severity == "critical"
    assert hang.cause == "process_stopped"
    assert "rank 1 on node-a" in hang.summary
    assert "its process is stopped" in hang.summary
    by_rank = {d.rank: d for d in hang.diagnoses}
    assert by_rank[1].process_state == "stopped"
    assert "train_ddp.py" in by_rank[1].stack_dump  # read without waking it
    assert by_rank[1].pid == victim
    assert not by_rank[1].healthy
    assert by_rank[0].healthy
    assert by_rank[0].node_id == "node-a"
    # The healthy rank waits in a collective the stopped one never joined: the step's all-reduce, or DDP's
    # gradient all-reduce inside backward (which one depends on where in its step the stopped rank was caught).
    assert any(frame in by_rank[0].stack_dump for frame in ("all_reduce", "backward")), by_rank[0].stack_dump
    assert "train_step" in by_rank[0].stack_dump
    # Progress again: the hang resolves by itself.
    resolved = wait_for(
        lambda: next((i for i in incidents(coordinator) if i.id == hang.id and i.state == RESOLVED), None),
        60,
        "the hang to resolve once rank 1 runs again",
    )
    assert resolved.resolved_unix_seconds >= resolved.opened_unix_seconds
    until.touch()
    assert job.wait(120) == 0, job.log()
    hangs = samples_named(
        scrape(coordinator.metrics_url), "clusterwatch_hangs_detected_total", training_job="stopped"
    )
    assert [s.value for s in hangs] == [1.0]


def test_a_slowed_rank_is_a_compute_straggler(cluster: Cluster, tmp_path: Path) -> None:
    coordinator, socket = start(cluster)
    until = tmp_path / "stop"
    job = cluster.torchrun(
        TRAIN,
        "--out-dir",
        str(tmp_path / "out"),
        "--job",
        "slow",
        "--until-file",
        str(until),
        "--compute-ms",
        "40",
        "--slow-rank",
        "2",
        "--slow-factor",
        "1.3",
        nproc=3,
        socket=socket,
    )
    straggler = wait_for(
        lambda: incident_of(coordinator, "straggler", 2), 120, "a straggler incident for rank 2"
    )
    ratios = {
        s.labels["rank"]: s.value
        for s in samples_named(
            scrape(coordinator.metrics_url), "clusterwatch_rank_slowdown_ratio", training_job="slow"
        )
    }
    until.touch()
    assert job.wait(120) == 0, job.log()
    assert list(straggler.ranks) == [2]
    assert list(straggler.nodes) == ["node-a"]
    assert straggler.cause == "compute"
    assert straggler.severity == "warning"
    assert 1.15 < straggler.evidence["slowdown_ratio"] < 1.6, dict(straggler.evidence)
    assert not [i for i in incidents(coordinator) if i.kind == "straggler" and 2 not in i.ranks]
    assert ratios["2"] > 1.15, ratios
    assert max(ratios["0"], ratios["1"]) < 1.1, ratios
    metrics = scrape(coordinator.metrics_url)
    detected = samples_named(
        metrics, "clusterwatch_stragglers_detected_total", training_job="slow", cause="compute"
    )
    assert [s.value for s in detected] == [1.0]


def test_a_killed_rank_is_a_failure_naming_it_and_the_signal(cluster: Cluster, tmp_path: Path) -> None:
    coordinator, socket = start(cluster)
    job = cluster.torchrun(
        TRAIN,
        "--out-dir",
        str(tmp_path / "out"),
        "--job",
        "killed",
        "--until-file",
        str(tmp_path / "never"),
        nproc=2,
        socket=socket,
    )
    wait_for_ranks_past(coordinator, "killed", 2, 5, 120)
    os.kill(ranks_of(coordinator, "killed")[1].identity.pid, signal.SIGKILL)
    failure = wait_for(
        lambda: incident_of(coordinator, "rank_failure", 1), 60, "a failure incident for rank 1"
    )
    assert job.wait(120) != 0
    assert list(failure.ranks) == [1]  # rank 0, torn down by torchrun afterwards, is not blamed
    assert failure.cause == "process_exited"
    assert failure.evidence["signal"] == signal.SIGKILL
    assert "SIGKILL" in failure.summary
    shown = json.loads(run_cli("incidents", "--all", "--json", "--coordinator", coordinator.address).stdout)
    assert failure.id in {i["id"] for i in shown}


def detection_rounds(coordinator: Coordinator) -> int:
    (rounds,) = samples_named(scrape(coordinator.metrics_url), "clusterwatch_detection_rounds_total")
    return int(rounds.value)


def test_a_healthy_run_opens_no_incident(cluster: Cluster, tmp_path: Path) -> None:
    coordinator, socket = start(cluster, "--hang-floor-s", "1")
    job = cluster.torchrun(
        TRAIN,
        "--out-dir",
        str(tmp_path / "out"),
        "--job",
        "healthy",
        "--steps",
        "300",
        "--compute-ms",
        "40",
        nproc=3,
        socket=socket,
    )
    assert job.wait(180) == 0, job.log()
    wait_for(lambda: {r.state for r in ranks_of(coordinator, "healthy").values()} == {EXITED}, 30, "exits")
    ranks = ranks_of(coordinator, "healthy")
    assert {r.last_step.step for r in ranks.values()} == {299}
    # Rounds that saw the finished job for longer than the hang floor: a
    # finished job must not look hung.
    after = detection_rounds(coordinator) + 6
    wait_for(lambda: detection_rounds(coordinator) >= after, 30, "six more detection rounds")
    found = incidents(coordinator)
    assert found == [], [(i.summary, i.opened_unix_seconds, i.resolved_unix_seconds) for i in found]
    text = run_cli("incidents", "--all", "--coordinator", coordinator.address).stdout
    assert text.strip() == "no incidents"
