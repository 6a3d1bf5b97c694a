"""Validate one RankReport and boil its steps down to what the job store keeps.

This runs on the event loop for every rank of every node report, so the
per-step work is done by C code wherever possible: ``attrgetter`` over the
repeated fields, ``zip`` to turn rows into columns, ``min``/``sum`` to
validate whole columns at once, slices to copy bucket counts. What remains in
Python is one small loop over the report's collective summaries, which the
agent has already merged per op, group, dtype and size bucket (so their
number does not grow with the steps; step summaries carry none and their
``collectives`` are never read). Most of the cost is protobuf's: touching a
sub-message of a freshly parsed report creates its Python wrapper (~1 us
each). bench/ingest.py --ranks measures the whole coordinator.

Validation is defence in depth (the agent validates too): a report that fails
is rejected whole, with a reason, and the other ranks of the node report are
still applied.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple

from clusterwatch.coordinator.model.step_ring import StepColumns
from clusterwatch.errors import InvalidReportError
from clusterwatch.v1 import training_pb2
from clusterwatch.wire.collective_stats import COLLECTIVE_DURATION_BUCKETS_S, bus_factor

# One duration bucket per bound plus +Inf.
DURATION_BUCKETS = len(COLLECTIVE_DURATION_BUCKETS_S) + 1

_STEP_ROW = attrgetter(
    "step", "start_unix_seconds", "step_seconds", "compute_seconds", "communication_seconds"
)
_COLLECTIVE_ROW = attrgetter(
    "op", "group_size", "count", "bytes_total", "duration_seconds_total", "duration_bucket_counts"
)
_CHECKPOINT_DURATION = attrgetter("duration_seconds")
# bus_factor is pure and sees a handful of (op, group size) pairs.
_bus_factor = functools.cache(bus_factor)


class RejectReason(enum.StrEnum):
    """Why a RankReport was not applied (the ``reason`` label of the rejection counter)."""

    MISSING_IDENTITY = "missing_identity"
    RANK_OUT_OF_RANGE = "rank_out_of_range"
    BAD_DURATION = "bad_duration"
    BAD_TIMESTAMP = "bad_timestamp"
    BAD_HISTOGRAM = "bad_histogram"
    # A valid report from an instance of the rank that a newer one replaced.
    STALE_INSTANCE = "stale_instance"
    # Labels that break clusterwatch/wire/job_labels.py's rules.
    BAD_LABELS = "bad_labels"
    # A valid report of a job that was ended on purpose (EndJob), from one of
    # its processes: its teardown, not news.
    JOB_ENDED = "job_ended"
    # A new instance of a rank from another node while the rank's current
    # instance still runs and reports: two nodes claim one rank.
    RANK_CONFLICT = "rank_conflict"


class RankReportError(InvalidReportError):
    """One RankReport broke the protocol; the rest of its node report still counts.

    Attributes:
        reason: the counted category.
    """

    def __init__(self, reason: RejectReason, detail: str) -> None:
        self.reason = reason
        super().__init__(detail)


class LastStep(NamedTuple):
    """A rank's newest finished step, without its collectives."""

    step: int
    start_unix_s: float
    step_s: float
    compute_s: float
    communication_s: float
    samples: float | None
    tokens: float | None

    def to_proto(self) -> training_pb2.StepSummary:
        summary = training_pb2.StepSummary(
            step=self.step,
            start_unix_seconds=self.start_unix_s,
            step_seconds=self.step_s,
            compute_seconds=self.compute_s,
            communication_seconds=self.communication_s,
        )
        if self.samples is not None:
            summary.samples = self.samples
        if self.tokens is not None:
            summary.tokens = self.tokens
        return summary


@dataclass(slots=True)
class CollectiveBatch:
    """One op's collectives over one report (summed over its steps and groups)."""

    calls: int
    bytes_total: int
    duration_s: float
    # Sum of bytes x the nccl-tests bus factor of each summary's group size;
    # divided by duration_s it is the bus bandwidth.
    bus_bytes: float
    bucket_counts: list[int]

    @property
    def bus_bandwidth_bytes_per_s(self) -> float | None:
        if self.duration_s <= 0 or self.bus_bytes <= 0:
            return None
        return self.bus_bytes / self.duration_s


@dataclass(slots=True)
class ParsedRankReport:
    """What one valid RankReport contributes, ready to apply.

    Attributes:
        kept: the report without its steps and checkpoint results, copied into its own
            arena: what the store keeps of it from report to report (heartbeat, exit,
            launcher exit, collectives) are parts of this copy. A part of the report as it arrived would keep the
            whole node report (every step of every rank) alive; one copy of the rest
            costs less than a copy of each part (~1 us against ~3 us per rank).
        columns: the report's steps column-wise, oldest first; None without steps.
        last_step: the newest step, or None without steps.
        collectives: per op, the report's collectives summed; empty without any.
    """

    kept: training_pb2.RankReport
    columns: StepColumns | None
    last_step: LastStep | None
    collectives: dict[str, CollectiveBatch]


def _kept(
    report: training_pb2.RankReport, results: Sequence[training_pb2.CheckpointResult]
) -> training_pb2.RankReport:
    kept = training_pb2.RankReport()
    kept.CopyFrom(report)
    kept.ClearField("steps")
    if results:
        kept.ClearField("checkpoint_results")
    return kept


def parse_rank_report(report: training_pb2.RankReport, max_steps: int | None = None) -> ParsedRankReport:
    """Validate ``report`` and extract its steps and its (merged) collectives.

    Args:
        report: one rank's report.
        max_steps: read only the newest this many steps (the rest would fall
            off the step ring anyway), so a report's cost stays bounded however
            many steps it carries.

    Raises:
        RankReportError: the report is malformed; nothing of it may be applied.
    """
    identity = report.identity
    if not identity.job:  # also when identity is unset
        raise RankReportError(RejectReason.MISSING_IDENTITY, "rank report without identity.job")
    if identity.rank >= identity.world_size:
        raise RankReportError(
            RejectReason.RANK_OUT_OF_RANGE,
            f"job {identity.job!r}: rank {identity.rank} >= world_size {identity.world_size}",
        )
    results = report.checkpoint_results
    if results and not _non_negative_finite(list(map(_CHECKPOINT_DURATION, results))):
        raise _bad_duration(identity, "checkpoint_results.duration_seconds")
    collectives = report.collectives
    batches = _group_collectives(identity, list(collectives)) if collectives else {}
    # One wrapper object per step, reused below: creating it is most of what
    # touching a freshly parsed sub-message costs.
    all_steps = report.steps
    steps = list(all_steps[-max_steps:] if max_steps and len(all_steps) > max_steps else all_steps)
    if not steps:
        return ParsedRankReport(_kept(report, results), None, None, batches)
    columns = StepColumns(*zip(*map(_STEP_ROW, steps), strict=True))
    if not math.isfinite(sum(columns.start_unix_s)):
        raise RankReportError(
            RejectReason.BAD_TIMESTAMP, f"{_who(identity)}: a step's start_unix_seconds is not finite"
        )
    # One expression for the three duration columns: NaN or +-Inf anywhere makes the total non-finite.
    if not (
        min(columns.step_s) >= 0.0
        and min(columns.compute_s) >= 0.0
        and min(columns.communication_s) >= 0.0
        and math.isfinite(sum(columns.step_s) + sum(columns.compute_s) + sum(columns.communication_s))
    ):
        raise _bad_duration(identity, "steps.step_seconds, compute_seconds or communication_seconds")
    newest = steps[-1]
    last_step = LastStep(
        columns.step[-1],
        columns.start_unix_s[-1],
        columns.step_s[-1],
        columns.compute_s[-1],
        columns.communication_s[-1],
        newest.samples if newest.HasField("samples") else None,
        newest.tokens if newest.HasField("tokens") else None,
    )
    return ParsedRankReport(_kept(report, results), columns, last_step, batches)


def _group_collectives(
    identity: training_pb2.RankIdentity, collectives: list[training_pb2.CollectiveSummary]
) -> dict[str, CollectiveBatch]:
    by_op: dict[str, CollectiveBatch] = {}
    bucket_lists: dict[str, list[list[int]]] = {}
    for op, group_size, calls, bytes_total, duration_s, counts in map(_COLLECTIVE_ROW, collectives):
        if not 0.0 <= duration_s < math.inf:  # also false for NaN
            raise _bad_duration(identity, "collectives.duration_seconds_total")
        if len(counts) != DURATION_BUCKETS:
            raise RankReportError(
                RejectReason.BAD_HISTOGRAM,
                f"{_who(identity)}: duration_bucket_counts must have {DURATION_BUCKETS} entries "
                "(see clusterwatch/wire/collective_stats.py)",
            )
        # A slice copies a repeated field in C; iterating it element by
        # element would cost ~10x more, and this runs per summary.
        batch = by_op.get(op)
        if batch is None:
            by_op[op] = CollectiveBatch(
                calls, bytes_total, duration_s, bytes_total * _bus_factor(op, group_size), counts[:]
            )
            continue
        batch.calls += calls
        batch.bytes_total += bytes_total
        batch.duration_s += duration_s
        batch.bus_bytes += bytes_total * _bus_factor(op, group_size)
        more = bucket_lists.get(op)
        if more is None:
            bucket_lists[op] = [batch.bucket_counts, counts[:]]
        else:
            more.append(counts[:])
    for op, lists in bucket_lists.items():
        by_op[op].bucket_counts = list(map(sum, zip(*lists, strict=True)))  # column sums in C
    return by_op


def _non_negative_finite(values: Sequence[float]) -> bool:
    # NaN and +-Inf make the sum non-finite; one C pass each instead of a check per value.
    return not values or (min(values) >= 0.0 and math.isfinite(sum(values)))


def _who(identity: training_pb2.RankIdentity) -> str:
    return f"job {identity.job!r} rank {identity.rank}"


def _bad_duration(identity: training_pb2.RankIdentity, field: str) -> RankReportError:
    return RankReportError(RejectReason.BAD_DURATION, f"{_who(identity)}: negative or non-finite {field}")
