"""Real torchrun jobs on gloo -> real agent (hook socket) -> real coordinator.

Each test starts a coordinator, an agent whose hook socket lives in the test's
tmp dir, and a torchrun job of tests/hook_workers/train_ddp.py; it then reads
what arrived through /metrics, the snapshot API and `clusterwatch status`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import (
    HOOK_WORKERS,
    Cluster,
    checkpoint_and_wait,
    ranks_of,
    run_cli,
    samples_named,
    scrape,
    start_node,
    wait_for,
    wait_for_ranks_past,
)

from clusterwatch.v1 import cluster_pb2, training_pb2

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

WORKERS = HOOK_WORKERS
TRAIN = WORKERS / "train_ddp.py"
ALLREDUCE_BYTES = 1 << 20


def rank_results(out_dir: Path, world_size: int) -> list[dict[str, object]]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def test_four_rank_job_reports_steps_and_all_reduces(cluster: Cluster, tmp_path: Path) -> None:
    coordinator, socket = start_node(cluster)
    until = tmp_path / "stop"
    job = cluster.torchrun(
        TRAIN,
        "--out-dir",
        str(tmp_path / "out"),
        "--job",
        "e2e",
        "--until-file",
        str(until),
        "--allreduce-bytes",
        str(ALLREDUCE_BYTES),
        nproc=4,
        socket=socket,
    )

    def every_rank_past_step(n: int) -> dict[int, cluster_pb2.RankStatus] | None:
        ranks = ranks_of(coordinator, "e2e")
        return ranks if len(ranks) == 4 and all(r.last_step.step >= n for r in ranks.values()) else None

    first = wait_for(lambda: every_rank_past_step(3), 120, "four ranks past step 3")
    # Past the furthest rank's first step by 3: every rank then has at least 3 steps more (the
    # ranks' reports arrive at different moments, so rank 0's step alone would not say so).
    furthest = max(status.last_step.step for status in first.values())
    later = wait_for(lambda: every_rank_past_step(furthest + 3), 60, "more steps")
    until.touch()
    assert job.wait(120) == 0, job.log()

    for rank, status in later.items():
        assert status.node_id == "node-a"
        assert status.identity.world_size == 4
        assert status.identity.pid > 0
        assert status.state == training_pb2.RANK_STATE_RUNNING
        assert status.identity.backend == "gloo"
        assert status.last_step.step_seconds > 0
        assert status.last_step.compute_seconds <= status.last_step.step_seconds
        ops = {b.op: b.bus_bandwidth_bytes_per_second for b in status.bandwidth}
        assert ops["all_reduce"] > 0, (rank, ops)
        assert "ddp_all_reduce" in ops
        # Heartbeats carry the Flight Recorder status of the default group.
        groups = {g.group_name: g for g in status.heartbeat.flight_recorder}
        assert status.heartbeat.flight_recorder_enabled
        assert groups["0"].last_enqueued_collective > 0
    # Sequence numbers agree across ranks: group "0" sees two collectives per
    # step (the DDP bucket and the explicit all-reduce), so every rank's last
    # all-reduce sequence is the same function of its last step.
    offsets = {r: _last_sequence(s, "all_reduce") - 2 * s.last_step.step for r, s in later.items()}
    assert len(set(offsets.values())) == 1, offsets
    assert all(later[r].last_step.step >= first[r].last_step.step + 3 for r in range(4))
    assert all(
        _last_sequence(later[r], "all_reduce") > _last_sequence(first[r], "all_reduce") for r in range(4)
    )

    samples = scrape(coordinator.metrics_url)
    assert {
        s.labels["rank"] for s in samples_named(samples, "clusterwatch_rank_step", training_job="e2e")
    } == {
        "0",
        "1",
        "2",
        "3",
    }
    info = samples_named(samples, "clusterwatch_rank_info", training_job="e2e", rank="2")
    assert info
    assert info[0].labels["node"] == "node-a"
    assert info[0].labels["pid"] == str(later[2].identity.pid)
    count = samples_named(samples, "clusterwatch_collectives_total", training_job="e2e", op="all_reduce")[
        0
    ].value
    size = samples_named(samples, "clusterwatch_collective_bytes_total", training_job="e2e", op="all_reduce")[
        0
    ].value
    assert count > 0
    assert size == count * ALLREDUCE_BYTES
    busbw = samples_named(
        samples, "clusterwatch_collective_bus_bandwidth_bytes_per_second", training_job="e2e", op="all_reduce"
    )
    assert {s.labels["rank"] for s in busbw} == {"0", "1", "2", "3"}
    assert all(s.value > 0 for s in busbw)
    histogram = samples_named(
        samples, "clusterwatch_collective_duration_seconds_count", training_job="e2e", op="all_reduce"
    )
    assert histogram
    assert histogram[0].value == count
    for name in (
        "clusterwatch_rank_step_duration_seconds",
        "clusterwatch_rank_compute_seconds",
        "clusterwatch_rank_communication_seconds",
        "clusterwatch_rank_last_progress_timestamp_seconds",
    ):
        assert len(samples_named(samples, name, training_job="e2e")) == 4, name
    assert samples_named(samples, "clusterwatch_job_step_rate", training_job="e2e")[0].value > 0

    status = run_cli("status", "--coordinator", coordinator.address, "--json")
    assert status.returncode == 0, status.stderr
    jobs = {j["job"]: j for j in json.loads(status.stdout)["jobs"]}
    assert sorted(r["rank"] for r in jobs["e2e"]["ranks"]) == [0, 1, 2, 3]
    text = run_cli("status", "--coordinator", coordinator.address)
    assert "e2e" in text.stdout
    assert "node-a" in text.stdout


def _last_sequence(status: cluster_pb2.RankStatus, op: str) -> int:
    return max((c.last_sequence for c in status.collectives if c.op == op), default=-1)


def test_a_rank_blocked_in_a_collective_keeps_heartbeating(cluster: Cluster, tmp_path: Path) -> None:
    coordinator, socket = start_node(cluster)
    release = tmp_path / "release"
    job = cluster.torchrun(
        TRAIN,
        "--out-dir",
        str(tmp_path / "out"),
        "--job",
        "stall",
        "--steps",
        "8",
        "--stall-rank",
        "1",
        "--stall-step",
        "5",
        "--stall-until-file",
        str(release),
        nproc=2,
        socket=socket,
    )

    def stalled() -> dict[int, cluster_pb2.RankStatus] | None:
        ranks = ranks_of(coordinator, "stall")
        if len(ranks) != 2 or ranks[0].heartbeat.collective.elapsed_seconds < 1.0:
            return None
        return ranks

    ranks = wait_for(stalled, 120, "rank 0 to sit in a collective for a second")
    waiting = ranks[0].heartbeat
    assert waiting.in_step
    assert waiting.step == 5
    assert waiting.collective.op == "all_reduce"
    assert waiting.collective.blocking
    # The straggler is still computing: in step 5, not in any collective.
    assert ranks[1].heartbeat.in_step
    assert ranks[1].heartbeat.step == 5
    assert not ranks[1].heartbeat.HasField("collective")
    # Heartbeats keep coming while rank 0 is blocked.
    beat = waiting.timestamp_unix_seconds
    wait_for(
        lambda: ranks_of(coordinator, "stall")[0].heartbeat.timestamp_unix_seconds > beat, 30, "a newer beat"
    )
    # The Flight Recorder agrees: rank 1 has enqueued fewer collectives on group "0".
    fr = {
        r: {g.group_name: g for g in s.heartbeat.flight_recorder}["0"]
        for r, s in ranks_of(coordinator, "stall").items()
    }
    assert fr[1].last_enqueued_collective < fr[0].last_enqueued_collective
    release.touch()
    assert job.wait(120) == 0, job.log()


def test_without_an_agent_the_job_completes_with_one_warning_per_rank(
    cluster: Cluster, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    job = cluster.torchrun(
        TRAIN, "--out-dir", str(out), "--steps", "10", nproc=2, socket=tmp_path / "none.sock"
    )
    assert job.wait(120) == 0, job.log()
    results = rank_results(out, 2)
    assert [r["end_step"] for r in results] == [10, 10]
    assert [r["hook_errors_total"] for r in results] == [0, 0]
    assert job.log().count("no agent at") == 2  # one per rank
    assert "Traceback" not in job.log()


def test_a_failure_inside_the_hook_is_counted_and_training_goes_on(cluster: Cluster, tmp_path: Path) -> None:
    coordinator, socket = start_node(cluster)
    out = tmp_path / "out"
    until = tmp_path / "stop"
    job = cluster.torchrun(
        TRAIN,
        "--out-dir",
        str(out),
        "--job",
        "broken",
        "--until-file",
        str(until),
        "--break-hook",
        nproc=2,
        socket=socket,
    )

    def errors_reported() -> bool:
        ranks = ranks_of(coordinator, "broken")
        return len(ranks) == 2 and all(r.heartbeat.health.errors_total > 0 for r in ranks.values())

    wait_for(errors_reported, 120, "both ranks to report their hook errors")
    samples = scrape(coordinator.metrics_url)
    assert all(
        s.value > 0
        for s in samples_named(samples, "clusterwatch_rank_hook_errors_total", training_job="broken")
    )
    until.touch()
    assert job.wait(120) == 0, job.log()
    results = rank_results(out, 2)
    assert all(r["end_step"] > 0 and r["hook_errors_total"] > 0 for r in results)


def test_checkpoint_on_request_then_resume_from_it(cluster: Cluster, tmp_path: Path) -> None:
    coordinator, socket = start_node(cluster)
    checkpoints = tmp_path / "ckpt"
    until = tmp_path / "stop"
    common = ("--job", "ckpt", "--checkpoint-dir", str(checkpoints))
    job = cluster.torchrun(
        TRAIN,
        "--out-dir",
        str(tmp_path / "out1"),
        "--until-file",
        str(until),
        *common,
        nproc=2,
        socket=socket,
    )
    wait_for_ranks_past(coordinator, "ckpt", 2, step=0, timeout_s=120)
    target = checkpoint_and_wait(coordinator, "ckpt", 60)
    until.touch()
    assert job.wait(120) == 0, job.log()
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        f"step{target}-rank0.pt",
        f"step{target}-rank1.pt",
    ]
    assert all(target in r["saved_steps"] for r in rank_results(tmp_path / "out1", 2))

    # A new run of the same job resumes one step after the complete checkpoint.
    rerun = cluster.torchrun(
        TRAIN, "--out-dir", str(tmp_path / "out2"), "--steps", "3", *common, nproc=2, socket=socket
    )
    assert rerun.wait(120) == 0, rerun.log()
    assert [r["start_step"] for r in rank_results(tmp_path / "out2", 2)] == [target + 1, target + 1]
