"""Node outages under real torchrun jobs (gloo): an agent SIGKILLed and restarted as systemd would,
and a network partition between one agent and the coordinator.

Lost reports are counted on both ends: the coordinator's gaps in each node's sequence
(``reports_missed_total``) and the agent's buffer overflows (``reports_dropped_total``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from helpers import (
    HOOK_WORKERS,
    Cluster,
    Coordinator,
    Process,
    job_status,
    ranks_of,
    samples_named,
    scrape,
    session_processes,
    wait_for,
    wait_for_ranks_past,
)
from tcp_proxy import TcpProxy

from clusterwatch.v1 import cluster_pb2

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

TRAIN = HOOK_WORKERS / "train_ddp.py"
UP = cluster_pb2.NodeState.NODE_STATE_UP
UNREACHABLE = cluster_pb2.NodeState.NODE_STATE_UNREACHABLE
HANG_FLOOR_S = 2.0


def agent_metric(agent: Process, name: str, node: str, **labels: str) -> float:
    port = wait_for(agent.logged_metrics_port, 30, f"{node}'s metrics port")
    (sample,) = samples_named(scrape(f"http://127.0.0.1:{port}/metrics"), name, node=node, **labels)
    return sample.value


def lost_reports(coordinator: Coordinator, agent: Process, node: str) -> int:
    """Reports of ``node`` that never reached the coordinator: sequence gaps plus buffer overflows."""
    status = coordinator.node(node)
    assert status is not None
    return status.reports_missed_total + int(
        agent_metric(agent, "clusterwatch_agent_reports_dropped_total", node)
    )


def furthest_step(coordinator: Coordinator, job: str, node: str) -> int:
    return max(r.last_step.step for r in ranks_of(coordinator, job).values() if r.node_id == node)


def test_agent_sigkill_and_restart_keeps_the_ranks_once_and_loses_no_report(
    cluster: Cluster, tmp_path: Path
) -> None:
    coordinator = cluster.coordinator()
    old_agent = cluster.agent(coordinator, "node-a", "--metrics-listen", "127.0.0.1:0")
    socket = cluster.socket_path("node-a")
    wait_for(socket.exists, 30, "the agent's hook socket")
    until = tmp_path / "stop"
    job = cluster.torchrun(
        TRAIN,
        "--out-dir",
        str(tmp_path / "out"),
        "--job",
        "steady",
        "--until-file",
        str(until),
        "--compute-ms",
        "20",
        nproc=2,
        socket=socket,
    )
    wait_for_ranks_past(coordinator, "steady", 2, 5, 120)
    pids = {rank: r.identity.pid for rank, r in ranks_of(coordinator, "steady").items()}
    assert lost_reports(coordinator, old_agent, "node-a") == 0

    old_agent.kill()  # SIGKILL, reaped: what systemd sees before it restarts the unit
    assert session_processes(old_agent.pid) == []  # nothing of the old agent is left
    before = furthest_step(coordinator, "steady", "node-a")
    new_agent = cluster.agent(coordinator, "node-a", "--metrics-listen", "127.0.0.1:0")

    # The hooks find the new agent on the same socket and their steps reach the coordinator again.
    wait_for_ranks_past(coordinator, "steady", 2, before + 20, 120)
    ranks = ranks_of(coordinator, "steady")
    status = job_status(coordinator, "steady")
    assert status is not None
    assert [r.identity.rank for r in status.ranks] == [0, 1]  # each rank once
    assert {rank: r.identity.pid for rank, r in ranks.items()} == pids  # the same processes
    assert agent_metric(new_agent, "clusterwatch_agent_hook_streams", "node-a") == 2
    assert agent_metric(new_agent, "clusterwatch_agent_ranks", "node-a", state="running") == 2
    node = coordinator.node("node-a")
    assert node is not None
    assert node.state == UP
    # The new agent instance numbers its reports from 1; the coordinator starts over with it.
    assert lost_reports(coordinator, new_agent, "node-a") == 0
    print(f"node-a: {node.reports_received_total} reports received, 0 lost across the agent's SIGKILL")

    until.touch()
    assert job.wait(120) == 0, job.log()
    assert session_processes(job.pid) == []
    assert not any(psutil.pid_exists(pid) for pid in pids.values())
    # Losing the agent and finding the new one is no error in the hooks.
    results = [json.loads((tmp_path / "out" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["hook_errors_total"] for r in results] == [0, 0]


@pytest.fixture
def rendezvous_endpoint() -> Iterator[str]:
    """A c10d rendezvous store for the two nodes' torchruns, outside both."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield f"127.0.0.1:{store.port}"
    del store


def torchrun_node(cluster: Cluster, endpoint: str, job: str, node: str, *args: str) -> Process:
    """One node's torchrun of a two-node job (``--nnodes 2``, one gloo rank each), hooked to its agent."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--max-restarts=0",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={job}",
        "--rdzv-conf=is_host=false",
        str(TRAIN),
        "--job",
        job,
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["CLUSTERWATCH_AGENT_SOCKET"] = str(cluster.socket_path(node))
    process = Process(argv, cluster.tmp_path / f"torchrun-{node}.log", env=env)
    cluster.processes.append(process)
    return process.start()


def incidents(coordinator: Coordinator, kind: str) -> list[cluster_pb2.Incident]:
    with coordinator.client() as client:
        return [i for i in client.incidents(include_resolved=True) if i.kind == kind]


def test_a_partitioned_node_is_unreachable_but_its_training_job_is_not_hung(
    cluster: Cluster, tmp_path: Path, rendezvous_endpoint: str
) -> None:
    coordinator = cluster.coordinator(
        "--hang-floor-s", str(HANG_FLOOR_S), "--heartbeat-stale-s", "1.5", "--dry-run"
    )
    with TcpProxy(coordinator.address) as proxy:
        cluster.agent(coordinator, "node-a")
        agent_b = cluster.agent(
            coordinator, "node-b", "--coordinator", proxy.address, "--metrics-listen", "127.0.0.1:0"
        )
        for node in ("node-a", "node-b"):
            wait_for(cluster.socket_path(node).exists, 30, f"{node}'s hook socket")
        until = tmp_path / "stop"
        launchers = {
            node: torchrun_node(
                cluster,
                rendezvous_endpoint,
                "split",
                node,
                "--out-dir",
                str(tmp_path / node),
                "--until-file",
                str(until),
                "--compute-ms",
                "30",
            )
            for node in ("node-a", "node-b")
        }
        wait_for_ranks_past(coordinator, "split", 2, 5, 120)
        ranks_on = {
            node: sorted(
                r.identity.rank for r in ranks_of(coordinator, "split").values() if r.node_id == node
            )
            for node in ("node-a", "node-b")
        }
        assert len(ranks_on["node-a"]) == len(ranks_on["node-b"]) == 1

        proxy.block()
        wait_for(lambda: coordinator.node("node-b").state == UNREACHABLE, 30, "node-b unreachable")  # type: ignore[union-attr]
        silent_since = coordinator.node("node-b").last_seen_unix_seconds  # type: ignore[union-attr]

        def silent_for_s() -> float:
            return coordinator.snapshot().timestamp_unix_seconds - silent_since

        # Well past the hang timeout in the coordinator's own view, and node-a's ranks still step.
        wait_for(lambda: silent_for_s() > 3 * HANG_FLOOR_S, 60, "node-b silent for three hang timeouts")
        reachable_step = furthest_step(coordinator, "split", "node-a")
        wait_for(
            lambda: (
                min(ranks_of(coordinator, "split")[r].last_step.step for r in ranks_on["node-a"])
                > reachable_step + 10
            ),
            60,
            "node-a's ranks to go on stepping",
        )
        assert incidents(coordinator, "hang") == []
        with coordinator.client() as client:
            assert client.actions(job="split") == []  # nothing restarted, nothing excluded
        (unreachable,) = incidents(coordinator, "node_unreachable")
        assert list(unreachable.nodes) == ["node-b"]
        assert unreachable.severity == "warning", unreachable.summary
        assert "only its link to the coordinator is down" in unreachable.summary

        # When the reachable ranks really stop, the job is hung, and they are named.
        stopped = [r.identity.pid for r in ranks_of(coordinator, "split").values() if r.node_id == "node-a"]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        try:

            def hang_naming_node_a() -> cluster_pb2.Incident | None:
                found = [i for i in incidents(coordinator, "hang") if set(ranks_on["node-a"]) <= set(i.ranks)]
                return found[0] if found else None

            hang = wait_for(hang_naming_node_a, 60, "a hang naming node-a's stopped ranks")
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        assert hang.cause == "heartbeat_stopped", hang.summary
        assert "node-a" in hang.nodes

        # Healed: node-b is back and replays what it buffered; nothing is lost.
        proxy.heal()
        wait_for(lambda: coordinator.node("node-b").state == UP, 60, "node-b back up")  # type: ignore[union-attr]
        wait_for(
            lambda: agent_metric(agent_b, "clusterwatch_agent_reports_buffered", "node-b") <= 2,
            60,
            "node-b to replay its buffer",
        )
        assert lost_reports(coordinator, agent_b, "node-b") == 0
        wait_for_ranks_past(coordinator, "split", 2, reachable_step + 20, 120)
        until.touch()
        for node, launcher in launchers.items():
            assert launcher.wait(120) == 0, f"{node}: {launcher.log()}"
