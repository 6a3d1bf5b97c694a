"""The Job / Ranks view: a row per rank, the stragglers and the hung rank marked."""

from __future__ import annotations

import collections

from clusterwatch.text.humanize import all_reduce_bus_bandwidth, bandwidth, duration, rank_state
from clusterwatch.tui.history import sparkline
from clusterwatch.tui.state import TopState
from clusterwatch.tui.views.rows import Cell, Column, Row, SortValue, Tone, number
from clusterwatch.v1 import cluster_pb2, training_pb2

STEP_HISTORY_WIDTH = 16
COLLECTIVE_MISMATCH = "collective_mismatch"
"""A hang's cause when the rank is in another collective than its peers (coordinator/detection/mismatch.py)."""
COLUMNS = (
    Column("RANK", 5, right=True),
    Column("NODE", 13, names=True),
    Column("STEP", 6, right=True),
    Column("TIME", 6, right=True),
    Column("COMP", 6, right=True),
    Column("COMM", 6, right=True),
    Column("SLOW", 5, right=True),
    Column("BUSBW", 8, right=True),
    Column("STATE", 16, flexible=True),
    Column("JOB", 10, names=True),
)


def rank_rows(state: TopState) -> list[Row]:
    live = [i for i in state.snapshot.incidents if i.job]
    rows = []
    for job in state.snapshot.jobs:
        incidents = [i for i in live if i.job == job.job]
        stragglers = {r: i for i in incidents if i.kind == "straggler" for r in i.ranks}
        hung = {r: i for i in incidents if i.kind == "hang" for r in i.ranks}
        orphaned = {r: i for i in incidents if i.kind == "orphaned_ranks" for r in i.ranks}
        missing = _missing_collective(job, set(hung))
        for rank in job.ranks:
            number_of = rank.identity.rank
            rows.append(
                _rank_row(
                    job.job,
                    rank,
                    straggling=stragglers.get(number_of),
                    hung=hung.get(number_of),
                    orphaned=number_of in orphaned,
                    missing=missing,
                )
            )
    return rows


def _rank_row(
    job: str,
    rank: cluster_pb2.RankStatus,
    *,
    straggling: cluster_pb2.Incident | None,
    hung: cluster_pb2.Incident | None,
    orphaned: bool,
    missing: str,
) -> Row:
    mark, tone = "", Tone.PLAIN
    if orphaned:  # its launcher died: nothing else about it matters as much
        mark, tone = "ORPHANED: launcher gone · ", Tone.ERROR
    elif hung is not None and hung.cause == COLLECTIVE_MISMATCH:
        # It is in another collective than its peers (the state says which), not missing theirs.
        mark, tone = "HUNG: collective mismatch · ", Tone.ERROR
    elif hung is not None:
        mark, tone = f"HUNG: {missing or hung.cause} · ", Tone.ERROR
    elif straggling is not None:
        mark, tone = f"STRAGGLER ({straggling.cause}) · ", Tone.WARNING
    elif rank.state != training_pb2.RANK_STATE_RUNNING:
        failed = rank.state == training_pb2.RANK_STATE_EXITED and not rank.exit.clean
        tone = Tone.ERROR if failed else Tone.MUTED
    number_of = rank.identity.rank

    def cells() -> tuple[Cell, ...]:
        last = rank.last_step if rank.HasField("last_step") else None
        slowdown = _slowdown(rank)
        return (
            Cell(str(number_of)),
            Cell(rank.node_id),
            Cell("-" if last is None else str(last.step)),
            Cell(duration(None if last is None else last.step_seconds)),
            Cell(duration(None if last is None else last.compute_seconds)),
            Cell(duration(None if last is None else last.communication_seconds)),
            Cell("-" if slowdown is None else f"{slowdown:.2f}x"),
            Cell(bandwidth(all_reduce_bus_bandwidth(rank))),
            Cell(mark + rank_state(rank)),
            Cell(job),
        )

    def sort_values() -> tuple[SortValue, ...]:
        if rank.HasField("last_step"):
            last = rank.last_step
            step_values: tuple[SortValue, ...] = (
                last.step,
                last.step_seconds,
                last.compute_seconds,
                last.communication_seconds,
            )
        else:
            step_values = (number(None),) * 4
        slowdown = number(_slowdown(rank))
        return (
            number_of,
            rank.node_id,
            *step_values,
            slowdown,
            number(all_reduce_bus_bandwidth(rank)),
            STATE_ORDER[tone],
            job,
        )

    return Row(f"{job}/{number_of}", cells, sort_values, tone, first_sort=number_of)


STATE_ORDER = {Tone.ERROR: 0, Tone.WARNING: 1, Tone.PLAIN: 2, Tone.ACCENT: 2, Tone.GOOD: 2, Tone.MUTED: 3}
"""Sorting by STATE: hung and failed ranks first, then stragglers, running, and the rest."""


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
        lines.append(
            [
                Cell(job.job, Tone.ACCENT),
                Cell(f"{len(job.ranks)}/{job.world_size} ranks"),
                Cell(rate),
                Cell("step"),
                Cell(sparkline(history, STEP_HISTORY_WIDTH, low=None), Tone.ACCENT),
                Cell(duration(history[-1] if history else None)),
                Cell(
                    checkpoint,
                    Tone.MUTED if not job.HasField("latest_complete_checkpoint_step") else Tone.PLAIN,
                ),
            ]
        )
    return lines


def _slowdown(rank: cluster_pb2.RankStatus) -> float | None:
    """The straggler detector's own ratio (clusterwatch_rank_slowdown_ratio): over its window, against
    the median of the *other* ranks, so top and Grafana agree; None before it has one."""
    return rank.slowdown_ratio if rank.HasField("slowdown_ratio") else None
