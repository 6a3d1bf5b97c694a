"""Collective mismatches on real torchrun jobs (gloo), four ranks on two nodes, named while they hang.

One rank leaves the common path at a step (tests/hook_workers/desync_worker.py):
a barrier where the others all-reduce, a skipped broadcast, an all-reduce of an
empty tensor. Every rank keeps heartbeating, each saying which collective it
is in; the coordinator must open a hang incident naming that rank, cause
``collective_mismatch``, with who is in what, and the stacks of that rank and a
peer. The three jobs share one coordinator and two agents (node-a: ranks 0-1,
node-b: ranks 2-3). How long naming took is printed, not asserted.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from helpers import HOOK_WORKERS, Cluster, Coordinator, Process, ranks_of, unused_port, wait_for

from clusterwatch.v1 import cluster_pb2

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

WORKER = HOOK_WORKERS / "desync_worker.py"
NODES = ("node-a", "node-b")
RANKS_PER_NODE = 2
ODD_RANK = 3  # on node-b
DESYNC_STEP = 30
# Per step: the payload's all-reduce, then the stop flag's broadcast (sequence numbers from 1).
ALL_REDUCE_AT_DESYNC = 2 * DESYNC_STEP + 1
BROADCAST_AT_DESYNC = 2 * DESYNC_STEP + 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Coordinator]]:
    cluster = Cluster(tmp_path_factory.mktemp("mismatch"))
    try:
        # Detection only: the recovery policy would restart a hung job (tests/e2e/test_recovery_e2e.py).
        coordinator = cluster.coordinator("--hang-action", "alert")
        for node_id in NODES:
            cluster.agent(coordinator, node_id)
        for node_id in NODES:
            wait_for(cluster.socket_path(node_id).exists, 30, f"{node_id}'s hook socket")
        yield cluster, coordinator
    finally:
        cluster.close()


def hang_named(
    cluster: tuple[Cluster, Coordinator], tmp_path: Path, job: str, desync: str
) -> tuple[cluster_pb2.Incident, float]:
    """Run the job with ``desync`` on rank 3; the diagnosed hang incident that names someone, and how
    long after rank 3 left the path it opened. The job is stopped, and its workers checked gone."""
    test_cluster, coordinator = cluster
    desync_file = tmp_path / "desync"
    port = unused_port()
    launched = [
        test_cluster.torchrun(
            WORKER,
            "--job",
            job,
            "--desync",
            desync,
            "--desync-rank",
            str(ODD_RANK),
            "--desync-step",
            str(DESYNC_STEP),
            "--desync-file",
            str(desync_file),
            nproc=RANKS_PER_NODE,
            socket=test_cluster.socket_path(node_id),
            nodes=(len(NODES), node_rank, f"127.0.0.1:{port}"),
        )
        for node_rank, node_id in enumerate(NODES)
    ]
    workers: set[int] = set()
    try:

        def named() -> cluster_pb2.Incident | None:
            workers.update(r.identity.pid for r in ranks_of(coordinator, job).values())
            with coordinator.client() as client:
                found = client.incidents(include_resolved=True)
            hang = next((i for i in found if i.job == job and i.kind == "hang" and i.ranks), None)
            # Diagnosed: each rank it names and one peer.
            return hang if hang is not None and len(hang.diagnoses) == len(hang.ranks) + 1 else None

        hang = wait_for(named, 120, f"a diagnosed hang incident of {job} naming a rank")
        left_path_unix_s = float(desync_file.read_text())
        return hang, hang.opened_unix_seconds - left_path_unix_s
    finally:
        stop(launched, workers)


def stop(launched: list[Process], workers: set[int]) -> None:
    """Stop both torchruns; their workers (each in a session of its own) must go with them."""
    for process in launched:
        process.stop()

    def alive() -> list[int]:
        found = []
        for pid in workers:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    found.append(pid)
            except psutil.NoSuchProcess:
                continue
        return found

    try:
        wait_for(lambda: not alive(), 30, "the job's workers to exit with torchrun")
    finally:
        for pid in alive():
            os.kill(pid, signal.SIGKILL)


def assert_named_with_stacks(hang: cluster_pb2.Incident, odd_frame: str, peer_frame: str) -> None:
    assert list(hang.ranks) == [ODD_RANK], hang.summary
    assert list(hang.nodes) == ["node-b"]
    assert hang.cause == "collective_mismatch"
    assert hang.severity == "critical"
    by_rank = {d.rank: d for d in hang.diagnoses}
    assert set(by_rank) == {0, ODD_RANK}  # the culprit and one peer
    assert not by_rank[ODD_RANK].healthy
    assert by_rank[0].healthy
    assert odd_frame in by_rank[ODD_RANK].stack_dump, by_rank[ODD_RANK].stack_dump
    assert peer_frame in by_rank[0].stack_dump, by_rank[0].stack_dump


def test_a_barrier_where_the_others_all_reduce_names_that_rank(
    cluster: tuple[Cluster, Coordinator], tmp_path: Path
) -> None:
    hang, after_s = hang_named(cluster, tmp_path, "desync-barrier", "barrier")
    print(f"barrier-for-all_reduce: rank {ODD_RANK} named {after_s:.1f} s after it entered the barrier")
    assert_named_with_stacks(hang, "barrier", "all_reduce")
    assert (
        f"rank 3 on node-b: in barrier #{ALL_REDUCE_AT_DESYNC} of group 0 while ranks 0, 1, 2 are in "
        f"all_reduce #{ALL_REDUCE_AT_DESYNC} (1.0MiB float32)"
    ) in hang.summary
    assert hang.evidence["collective_sequence"] == ALL_REDUCE_AT_DESYNC


def test_a_skipped_collective_names_the_rank_ahead_of_its_peers(
    cluster: tuple[Cluster, Coordinator], tmp_path: Path
) -> None:
    hang, after_s = hang_named(cluster, tmp_path, "desync-skip", "skip")
    print(f"skipped broadcast: rank {ODD_RANK} named {after_s:.1f} s after it skipped the broadcast")
    assert_named_with_stacks(hang, "all_reduce", "all_reduce")
    # gloo: the broadcast's root and rank 2 completed it without rank 3 and wait in the next step's
    # all_reduce; rank 1 waits for its part of the broadcast, which goes through rank 3.
    assert (
        f"rank 3 on node-b: in all_reduce #{BROADCAST_AT_DESYNC} (1.0MiB float32) of group 0 in step "
        f"{DESYNC_STEP + 1}, where ranks 0, 2 are in #{ALL_REDUCE_AT_DESYNC + 2}: it counts 1 collective fewer "
        "than they do, so it skipped 1 collective they made (it is ahead of them)"
    ) in hang.summary


def test_an_empty_tensor_on_one_rank_names_it_one_collective_ahead(
    cluster: tuple[Cluster, Coordinator], tmp_path: Path
) -> None:
    # gloo completes the empty all-reduce alone: the rank goes one collective ahead, and the
    # Flight Recorder shows its peers one behind it, which used to name them instead.
    hang, after_s = hang_named(cluster, tmp_path, "desync-empty", "empty")
    print(f"empty tensor: rank {ODD_RANK} named {after_s:.1f} s after its empty all_reduce")
    assert_named_with_stacks(hang, "broadcast", "all_reduce")
    assert (
        f"rank 3 on node-b: in broadcast #{BROADCAST_AT_DESYNC} (4B float32) of group 0 while ranks 0, 1, 2 are in "
        f"all_reduce #{ALL_REDUCE_AT_DESYNC} (1.0MiB float32): 1 collective ahead of them"
    ) in hang.summary
