"""Training series on /metrics, JobStatus in snapshots, and `clusterwatch status` with jobs:
unit tests of the writers, then a real coordinator fed over real agent streams."""

from __future__ import annotations

import json
import math

import pytest
from helpers import Cluster, Coordinator, run_cli, samples_named, scrape
from prometheus_client.parser import text_string_to_metric_families
from training_builders import (
    EXITED,
    T0,
    AgentStream,
    checkpoint_ok,
    collective,
    poll_until,
    rank_report,
    step,
)

from clusterwatch.coordinator.metrics.training import TRAINING_FAMILIES, write_training
from clusterwatch.coordinator.model.checkpoints import CheckpointTracker, LatestCheckpoint
from clusterwatch.coordinator.model.jobs import JobStore
from clusterwatch.coordinator.views.jobs import job_status, training_view
from clusterwatch.exposition.promtext import Exposition, histogram
from clusterwatch.v1 import cluster_pb2, training_pb2
from clusterwatch.wire.collective_stats import COLLECTIVE_DURATION_BUCKETS_S, bus_factor

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20


def test_histogram_writer_is_cumulative_and_parses() -> None:
    exp = Exposition()
    family = histogram("x_duration_seconds", "help")
    exp.add_histogram(family, 'op="a"', (0.1, 1.0), (2, 0, 3), 4.5)
    exp.add_histogram(family, "", (0.1, 1.0), (0, 1, 0), 0.5)
    (parsed,) = text_string_to_metric_families(exp.render().decode())
    assert parsed.type == "histogram"
    values = {(s.name, s.labels.get("op", ""), s.labels.get("le", "")): s.value for s in parsed.samples}
    assert values[("x_duration_seconds_bucket", "a", "0.1")] == 2
    assert values[("x_duration_seconds_bucket", "a", "1.0")] == 2
    assert values[("x_duration_seconds_bucket", "a", "+Inf")] == 5
    assert values[("x_duration_seconds_count", "a", "")] == 5
    assert values[("x_duration_seconds_sum", "a", "")] == 4.5
    assert values[("x_duration_seconds_count", "", "")] == 1
    with pytest.raises(ValueError, match="counts"):
        exp.add_histogram(family, "", (0.1,), (1,), 0.0)
    with pytest.raises(ValueError, match="suffix"):
        histogram("x_seconds_count", "help")


def test_training_family_names_follow_conventions() -> None:
    names = [f.name for f in TRAINING_FAMILIES]
    assert len(names) == len(set(names))
    for family in TRAINING_FAMILIES:
        assert family.name.startswith("clusterwatch_")
        assert len(family.help) > 40, family.name  # says what a bad value means
        assert (family.kind == "counter") == family.name.endswith("_total"), family.name


def two_rank_store() -> JobStore:
    store = JobStore()
    in_collective = training_pb2.Heartbeat(
        timestamp_unix_seconds=T0 + 9,
        step=3,
        in_step=True,
        collective=training_pb2.CollectiveInFlight(op="all_reduce", sequence=12, elapsed_seconds=4.0),
        health=training_pb2.HookHealth(errors_total=1, messages_dropped_total=2),
    )
    # Two steps of one 8 MiB all-reduce each, as the agent merges them.
    rank0 = rank_report(
        0,
        steps=[step(1), step(2)],
        collectives=[collective(calls=2, bytes_total=16 * MIB, duration_s=0.008)],
        heartbeat=in_collective,
    )
    rank1 = rank_report(
        1,
        steps=[step(n, compute_s=0.45) for n in (1, 2)],
        collectives=[collective(calls=2, bytes_total=16 * MIB, duration_s=0.004)],
    )
    store.ingest("node-a", [rank0], now_mono=1.0, now_unix=T0 + 10)
    store.ingest("node-b", [rank1], now_mono=1.0, now_unix=T0 + 10)
    store.ingest(
        "node-b",
        [rank_report(0, job="old", world_size=1, state=EXITED, exit=training_pb2.RankExit(description="x"))],
        now_mono=1.0,
        now_unix=T0,
    )
    bad = rank_report(0, job="bad", world_size=1)
    bad.identity.rank = 5
    store.ingest("node-c", [bad], now_mono=1.0, now_unix=T0)
    return store


def parse(page: bytes) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(page.decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_a_job_becomes_the_expected_samples() -> None:
    tracker = CheckpointTracker({"train": LatestCheckpoint(2, T0 + 5)})
    tracker.record("train", 2, 0, training_pb2.CheckpointResult(step=4, ok=False), now_unix_s=T0)
    exp = Exposition()
    write_training(exp, training_view(two_rank_store(), tracker, now_mono=1.0))
    m = parse(exp.render())
    j = {"training_job": "train"}
    assert m["clusterwatch_job_world_size"] == [({"training_job": "old"}, 1.0), (j, 2.0)]
    ranks = {(lbl["training_job"], lbl["state"]): v for lbl, v in m["clusterwatch_job_ranks"]}
    assert ranks[("train", "running")] == 2
    assert ranks[("old", "exited")] == 1
    assert m["clusterwatch_job_step_rate"] == [(j, pytest.approx(2.0))]
    assert m["clusterwatch_last_complete_checkpoint_step"] == [(j, 2.0)]
    assert m["clusterwatch_job_latest_complete_checkpoint_timestamp_seconds"] == [(j, T0 + 5)]
    assert "clusterwatch_checkpoint_duration_seconds" not in m  # its save time is unknown
    assert m["clusterwatch_job_checkpoint_results_total"] == [({**j, "result": "failed"}, 1.0)]
    outcomes = {(lbl["training_job"], lbl["outcome"]): v for lbl, v in m["clusterwatch_checkpoints_total"]}
    assert outcomes == {
        ("old", "complete"): 0,
        ("old", "failed"): 0,
        ("old", "incomplete"): 0,
        ("train", "complete"): 0,
        ("train", "failed"): 1,
        ("train", "incomplete"): 0,
    }
    op = {**j, "op": "all_reduce"}
    assert m["clusterwatch_collectives_total"] == [(op, 4.0)]
    assert m["clusterwatch_collective_bytes_total"] == [(op, 32.0 * MIB)]
    buckets = {lbl["le"]: v for lbl, v in m["clusterwatch_collective_duration_seconds_bucket"]}
    assert buckets["0.001"] == 0
    assert buckets["0.0025"] == 2  # rank 1's two 2 ms calls
    assert buckets["0.005"] == 4
    assert buckets["+Inf"] == 4
    assert len(buckets) == len(COLLECTIVE_DURATION_BUCKETS_S) + 1
    assert m["clusterwatch_collective_duration_seconds_count"] == [(op, 4.0)]
    assert m["clusterwatch_collective_duration_seconds_sum"] == [(op, pytest.approx(0.012))]
    r0, r1 = {**j, "rank": "0"}, {**j, "rank": "1"}
    assert ({**r0, "node": "node-a", "local_rank": "0", "pid": "1000", "gpu_uuid": "GPU-0000"}, 1.0) in m[
        "clusterwatch_rank_info"
    ]
    assert (r0, 2.0) in m["clusterwatch_rank_step"]
    assert (r1, 0.5) in m["clusterwatch_rank_step_duration_seconds"]
    assert (r1, 0.45) in m["clusterwatch_rank_compute_seconds"]
    assert (r1, pytest.approx(0.05)) in m["clusterwatch_rank_communication_seconds"]
    assert (r0, T0 + 10) in m["clusterwatch_rank_last_progress_timestamp_seconds"]
    assert (r0, T0 + 9) in m["clusterwatch_rank_heartbeat_timestamp_seconds"]
    assert m["clusterwatch_rank_in_collective"] == [(r0, 1.0), (r1, 0.0)]
    assert (r0, 1.0) in m["clusterwatch_rank_hook_errors_total"]
    assert (r0, 2.0) in m["clusterwatch_rank_hook_messages_dropped_total"]
    busbw = {lbl["rank"]: v for lbl, v in m["clusterwatch_collective_bus_bandwidth_bytes_per_second"]}
    assert busbw["0"] == pytest.approx(16 * MIB * bus_factor("all_reduce", 2) / 0.008)
    assert busbw["1"] == pytest.approx(16 * MIB / 0.004)
    assert m["clusterwatch_rank_reports_rejected_total"] == [
        ({"node": "node-c", "reason": "rank_out_of_range"}, 1.0)
    ]


def test_a_completed_checkpoint_becomes_step_duration_and_outcomes() -> None:
    tracker = CheckpointTracker()
    tracker.record("train", 2, 0, checkpoint_ok(6, 0, duration_s=2.0), now_unix_s=T0)  # superseded by 8
    tracker.record("train", 2, 0, checkpoint_ok(8, 0, duration_s=2.0), now_unix_s=T0)
    tracker.record("train", 2, 1, checkpoint_ok(8, 1, duration_s=3.5), now_unix_s=T0 + 1)
    exp = Exposition()
    write_training(exp, training_view(two_rank_store(), tracker, now_mono=1.0))
    m = parse(exp.render())
    j = {"training_job": "train"}
    assert m["clusterwatch_last_complete_checkpoint_step"] == [(j, 8.0)]
    assert m["clusterwatch_job_latest_complete_checkpoint_timestamp_seconds"] == [(j, T0 + 1)]
    assert m["clusterwatch_checkpoint_duration_seconds"] == [(j, 3.5)]  # the slowest rank
    outcomes = {
        lbl["outcome"]: v for lbl, v in m["clusterwatch_checkpoints_total"] if lbl["training_job"] == "train"
    }
    assert outcomes == {"complete": 1, "failed": 0, "incomplete": 1}
    assert m["clusterwatch_job_checkpoint_results_total"] == [({**j, "result": "ok"}, 3.0)]


def test_job_status_carries_ranks_without_step_collectives() -> None:
    view = training_view(two_rank_store(), CheckpointTracker(), now_mono=1.0)
    status = job_status(view.jobs[1])
    assert (status.job, status.world_size, status.HasField("latest_complete_checkpoint_step")) == (
        "train",
        2,
        False,
    )
    assert status.step_rate == pytest.approx(2.0)
    rank0 = status.ranks[0]
    assert (rank0.identity.rank, rank0.node_id, rank0.last_step.step) == (0, "node-a", 2)
    assert not rank0.last_step.collectives
    assert rank0.heartbeat.collective.sequence == 12
    assert [b.op for b in rank0.bandwidth] == ["all_reduce"]
    assert [(c.op, c.count) for c in rank0.collectives] == [("all_reduce", 2)]
    assert math.isclose(rank0.last_progress_unix_seconds, T0 + 10)


def job_named(coordinator: Coordinator, job: str) -> cluster_pb2.JobStatus | None:
    with coordinator.client() as client:
        for status in client.snapshot(summary_only=True).jobs:
            if status.job == job:
                return status
    return None


async def test_ranks_reach_metrics_snapshot_and_status(cluster: Cluster) -> None:
    coordinator = cluster.coordinator()
    busy = training_pb2.Heartbeat(
        timestamp_unix_seconds=T0 + 30,
        step=21,
        in_step=True,
        collective=training_pb2.CollectiveInFlight(op="all_reduce", sequence=77, elapsed_seconds=12.5),
    )
    async with (
        AgentStream(coordinator.address, "node-a") as node_a,
        AgentStream(coordinator.address, "node-b") as node_b,
    ):
        for first in (1, 11):
            steps = [step(n) for n in range(first, first + 10)]
            merged = [collective(calls=10, bytes_total=40 * MIB, duration_s=0.08, last_sequence=first + 9)]
            await node_a.report(
                rank_report(0, world_size=3, steps=steps, collectives=merged),
                rank_report(1, world_size=3, steps=steps, collectives=merged),
            )
            await node_b.report(
                rank_report(
                    2,
                    world_size=3,
                    steps=steps[:5],
                    collectives=[collective(calls=5, bytes_total=20 * MIB, duration_s=0.04)],
                ),
            )
        await node_a.report(rank_report(0, world_size=3, heartbeat=busy))
        exited = training_pb2.RankExit(timestamp_unix_seconds=T0, exit_code=1, description="exit_code 1")
        await node_b.report(rank_report(2, world_size=3, state=EXITED, exit=exited))

        def ready() -> bool:
            status = job_named(coordinator, "train")
            return status is not None and len(status.ranks) == 3 and status.ranks[2].state == EXITED

        await poll_until(ready, 20, "three ranks, rank 2 exited")

        samples = await poll_until(lambda: scrape(coordinator.metrics_url), 10, "a scrape")
        j = {"training_job": "train"}
        assert [s.value for s in samples_named(samples, "clusterwatch_job_world_size", **j)] == [3]
        assert samples_named(samples, "clusterwatch_job_ranks", **j, state="running")[0].value == 2
        assert samples_named(samples, "clusterwatch_job_ranks", **j, state="exited")[0].value == 1
        assert samples_named(samples, "clusterwatch_rank_step", **j, rank="0")[0].value == 20
        assert samples_named(samples, "clusterwatch_rank_step", **j, rank="2")[0].value == 15
        assert samples_named(samples, "clusterwatch_rank_in_collective", **j, rank="0")[0].value == 1
        assert samples_named(samples, "clusterwatch_collectives_total", **j, op="all_reduce")[0].value == 50
        assert samples_named(samples, "clusterwatch_collective_duration_seconds_count", **j)[0].value == 50
        info = samples_named(samples, "clusterwatch_rank_info", **j, rank="2")[0]
        assert info.labels["node"] == "node-b"
        busbw = samples_named(
            samples, "clusterwatch_collective_bus_bandwidth_bytes_per_second", **j, rank="1"
        )
        assert busbw[0].value == pytest.approx(4 * MIB / 0.008)

        with coordinator.client() as client:
            full = client.snapshot()
        (job,) = [s for s in full.jobs if s.job == "train"]
        assert [r.node_id for r in job.ranks] == ["node-a", "node-a", "node-b"]
        assert job.ranks[0].last_step.step == 20
        assert [(c.op, c.last_sequence) for c in job.ranks[0].collectives] == [("all_reduce", 20)]
        assert job.ranks[2].exit.description == "exit_code 1"
        assert all(not n.report.ranks for n in full.nodes)  # rank data lives in jobs only

        text = await poll_until(lambda: run_cli("status", "--coordinator", coordinator.address), 30, "status")
        assert text.returncode == 0, text.stderr
        lines = text.stdout.splitlines()
        assert any(line.startswith("JOB train  world size 3") for line in lines), text.stdout
        rank_rows = {line.split()[0]: line for line in lines if line[:1].isdigit() and "node-" in line}
        assert rank_rows["0"].split()[1:] == [
            "node-a",
            "20",
            "500ms",
            "400ms",
            "100ms",
            "524MB/s",
            "in",
            "all_reduce",
            "#77",
            "12.50s",
        ]
        assert rank_rows["2"].endswith("exited: exit_code 1")
        jobs_section = lines[next(i for i, line in enumerate(lines) if line.startswith("JOB")) :]
        assert max(len(line) for line in jobs_section) <= 80, text.stdout

        as_json = run_cli("status", "--json", "--coordinator", coordinator.address)
        document = json.loads(as_json.stdout)
        (train,) = [j for j in document["jobs"] if j["job"] == "train"]
        assert train["world_size"] == 3
        assert [(r["rank"], r["identity"]["rank"]) for r in train["ranks"]] == [(0, 0), (1, 1), (2, 2)]
        assert train["ranks"][0]["last_step"]["step"] == 20
        assert train["ranks"][2]["state"] == "RANK_STATE_EXITED"
