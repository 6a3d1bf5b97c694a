"""The Job / Ranks view: a row per rank, the stragglers and the hung rank marked."""

from __future__ import annotations

import collections
import statistics

from clusterwatch.humanize import bandwidth, duration, rank_state
from clusterwatch.tui.history import sparkline
from clusterwatch.tui.state import TopState
from clusterwatch.tui.views.rows import Cell, Column, Row, Tone, number
from clusterwatch.v1 import cluster_pb2, training_pb2

ALL_REDUCE_OPS = ("all_reduce", "ddp_all_reduce")
"""Ops whose bus bandwidth the rows show (the gradient all-reduce)."""
STEP_HISTORY_WIDTH = 16
COLUMNS = (
    Column("RANK", 5, right=True),
    Column("NODE", 13),
    Column("STEP", 6, right=True),
    Column("TIME", 6, right=True),
    Column("COMP", 6, right=True),
    Column("COMM", 6, right=True),
    Column("SLOW", 5, right=True),
    Column("BUSBW", 8, right=True),
    Column("STATE", 16, flexible=True),
    Column("JOB", 10),
)


def rank_rows(state: TopState) -> list[Row]:
    live = [i for i in state.snapshot.incidents if i.job]
    rows = []
    for job in state.snapshot.jobs:
        incidents = [i for i in live if i.job == job.job]
        stragglers = {r: i for i in incidents if i.kind == "straggler" for r in i.ranks}
        hung = {r: i for i in incidents if i.kind == "hang" for r in i.ranks}
        missing = _missing_collective(job, set(hung))
        compute = [r.last_step.compute_seconds for r in job.ranks if r.HasField("last_step")]
        typical = statistics.median(compute) if compute else None
        for rank in job.ranks:
            rows.append(_rank_row(job.job, rank=rank, typical_compute_s=typical,
                                  straggling=stragglers.get(rank.identity.rank),
                                  hung=hung.get(rank.identity.rank), missing=missing))  # fmt: skip
    return rows


def _rank_row(
    job: str,
    *,
    rank: cluster_pb2.RankStatus,
    typical_compute_s: float | None,
    straggling: cluster_pb2.Incident | None,
    hung: cluster_pb2.Incident | None,
    missing: str,
) -> Row:
    last = rank.last_step if rank.HasField("last_step") else None
    slowdown = last.compute_seconds / typical_compute_s if last is not None and typical_compute_s else None
    busbw = [b.bus_bandwidth_bytes_per_second for b in rank.bandwidth if b.op in ALL_REDUCE_OPS]
    text, tone = rank_state(rank), Tone.PLAIN
    if hung is not None:
        text, tone = f"HUNG: {missing or hung.cause} · {text}", Tone.ERROR
    elif straggling is not None:
        text, tone = f"STRAGGLER ({straggling.cause}) · {text}", Tone.WARNING
    elif rank.state == training_pb2.RANK_STATE_EXITED and not rank.exit.clean:
        tone = Tone.ERROR
    elif rank.state != training_pb2.RANK_STATE_RUNNING:
        tone = Tone.MUTED
    number_of = rank.identity.rank
    cells = (
        Cell(str(number_of)),
        Cell(rank.node_id),
        Cell("-" if last is None else str(last.step)),
        Cell(duration(None if last is None else last.step_seconds)),
        Cell(duration(None if last is None else last.compute_seconds)),
        Cell(duration(None if last is None else last.communication_seconds)),
        Cell("-" if slowdown is None else f"{slowdown:.2f}x"),
        Cell(bandwidth(max(busbw) if busbw else None)),
        Cell(text),
        Cell(job),
    )
    sort_values = (
        number_of, rank.node_id, number(None if last is None else last.step),
        number(None if last is None else last.step_seconds), number(None if last is None else last.compute_seconds),
        number(None if last is None else last.communication_seconds), number(slowdown),
        number(max(busbw) if busbw else None), text, job,
    )  # fmt: skip
    return Row(f"{job}/{number_of}", cells, sort_values, tone)


def _missing_collective(job: cluster_pb2.JobStatus, hung_ranks: set[int]) -> str:
    """The collective the hung ranks' peers are waiting in, which the hung ranks never joined."""
    if not hung_ranks:
        return ""
    waiting = collections.Counter(
        (r.heartbeat.collective.op, r.heartbeat.collective.sequence)
        for r in job.ranks
        if r.identity.rank not in hung_ranks and r.heartbeat.HasField("collective")
    )
    if not waiting:
        return ""
    (op, sequence), peers = waiting.most_common(1)[0]
    return f"missing {op} #{sequence} ({peers} peers waiting)"


def job_lines(state: TopState) -> list[list[Cell]]:
    """A line per job above the table: size, rate, step-time history, checkpoint."""
    lines = []
    for job in state.snapshot.jobs:
        history = state.job_step_time.series(job.job)
        rate = f"{job.step_rate:.2f} steps/s" if job.HasField("step_rate") else "rate -"
        checkpoint = (
            f"checkpoint @{job.latest_complete_checkpoint_step}"
            if job.HasField("latest_complete_checkpoint_step")
            else "no checkpoint"
        )
        lines.append([
            Cell(job.job, Tone.ACCENT),
            Cell(f"{len(job.ranks)}/{job.world_size} ranks"),
            Cell(rate),
            Cell("step"),
            Cell(sparkline(history, STEP_HISTORY_WIDTH, low=None), Tone.ACCENT),
            Cell(duration(history[-1] if history else None)),
            Cell(checkpoint, Tone.MUTED if not job.HasField("latest_complete_checkpoint_step") else Tone.PLAIN),
        ])  # fmt: skip
    return lines
