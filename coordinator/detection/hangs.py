"""Hang detection: a pure function of one job's state and the coordinator's clock.

A job is hung when no rank has finished a step for longer than an adaptive
timeout, ``max(floor_s, p99_factor x p99 of its recent step times)``: a job
with 100 ms steps is hung after the floor (5 s), one with 10 s steps after
30 s. PyTorch's own watchdog waits 10-30 minutes.

The culprits, in the order a person would check them:

1. ranks that exited (the agent saw the process end);
2. ranks whose heartbeat stopped advancing (a frozen or stopped process: the
   hook's heartbeat thread runs even while training is blocked in a
   collective, so silence means the whole process is stuck);
3. ranks in another collective than the rest of their process group at the
   same point (another op, size or dtype at the same sequence, or a sequence
   ahead or behind while the whole group waits): a collective mismatch
   (coordinator/detection/mismatch.py), a bug in the program that no waiting resolves;
   it comes before 4 because a rank that went past the others' collective
   must not make them look behind;
4. ranks whose Flight Recorder ``last_enqueued_collective`` is behind the rest
   of their process group: they never joined the collective everyone else
   waits in (docs/SIGNALS.md). In a group with a mismatch, its odd ranks
   and the ranks waiting in its collectives are left out: those joined, and
   the mismatch is why their collective cannot complete;
5. ranks on a node that stopped reporting (unreachable): nothing is known of
   them now, so they come last, and only their node is blamed.

If none of these names anyone and every rank waits in the same collective
(same group and sequence), the finding says so: the collective itself is
stuck, and the fabric under it is the next suspect.

Progress is judged from the ranks whose news still arrives. A rank on an
unreachable node has not necessarily stopped, only its reports have (the
node's agent may be cut off from the coordinator while training goes on), and
its peers on the other nodes tell: a collective completes only once every
rank has joined it, so while they finish steps it does too. A job with no rank
on a reachable node is not judged at all; the node_unreachable incident says
what is known. Ranks on unreachable nodes are never called frozen, mismatched
or behind on their stale heartbeats, nor are frozen ranks mismatched.

Heartbeats are compared on the coordinator's monotonic clock (when a newer one
last arrived), never on the ranks' wall clocks, so skew between hosts cannot
fake a frozen rank.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Collection
from typing import NamedTuple

from clusterwatch.coordinator.detection.mismatch import Mismatch, find_mismatches, group_sizes, position
from clusterwatch.coordinator.model.jobs import JobRecord, RankRecord
from clusterwatch.v1 import training_pb2

# Ranks whose step times the p99 is taken over (see timeout_s).
P99_SAMPLE_RANKS = 64
# Culprits a finding's summary names, in the order above; the rest are counted. A hung job's
# summary once named every rank of its unreachable nodes: 250 KB at 4,000 culprits, rebuilt,
# stored and shown every round. The incident's ranks and nodes still list them all.
SUMMARY_CULPRITS = 10
EXITED = training_pb2.RANK_STATE_EXITED
RUNNING = training_pb2.RANK_STATE_RUNNING


@dataclasses.dataclass(frozen=True)
class HangSettings:
    """Thresholds of the hang detector.

    Attributes:
        floor_s: never call a job hung sooner than this.
        p99_factor: hung after this many times the p99 of recent step times.
        heartbeat_stale_s: a rank whose heartbeat has not advanced for this
            long is frozen (heartbeats come every second by default).
    """

    floor_s: float = 5.0
    p99_factor: float = 3.0
    heartbeat_stale_s: float = 5.0


class CulpritReason(enum.StrEnum):
    EXITED = "exited"
    HEARTBEAT_STOPPED = "heartbeat_stopped"
    COLLECTIVE_MISMATCH = "collective_mismatch"
    BEHIND_IN_GROUP = "behind_in_group"
    NODE_UNREACHABLE = "node_unreachable"


@dataclasses.dataclass(frozen=True)
class Culprit:
    rank: int
    node_id: str
    reason: CulpritReason
    detail: str


@dataclasses.dataclass(frozen=True)
class SharedCollective:
    """Every rank waits in this one collective."""

    op: str
    group_name: str
    sequence: int


@dataclasses.dataclass(frozen=True)
class HangFinding:
    """A hung job.

    Attributes:
        mismatches: the process groups whose ranks are in different
            collectives (their odd ranks are culprits too).
    """

    job: str
    stalled_s: float
    timeout_s: float
    last_step: int
    culprits: tuple[Culprit, ...]
    shared_collective: SharedCollective | None
    mismatches: tuple[Mismatch, ...] = ()

    @property
    def summary(self) -> str:
        head = f"job {self.job} made no progress for {self.stalled_s:.1f} s (timeout {self.timeout_s:.1f} s)"
        if self.culprits:
            named = "; ".join(
                f"rank {c.rank} on {c.node_id}: {c.detail}" for c in self.culprits[:SUMMARY_CULPRITS]
            )
            more = len(self.culprits) - SUMMARY_CULPRITS
            return f"{head}; {named}" + (
                f"; and {more} more ranks (the incident names them)" if more > 0 else ""
            )
        if self.shared_collective is not None:
            c = self.shared_collective
            return f"{head}; every rank waits in {c.op} #{c.sequence} of group {c.group_name}"
        return head


def timeout_s(job: JobRecord, settings: HangSettings) -> float:
    """The job's hang timeout: the floor, or p99_factor x the p99 of its recent step times.

    The collectives make every rank's step time the same, so up to
    P99_SAMPLE_RANKS ranks, evenly spread, stand for all (sorting every step of
    1,024 ranks each round cost ~4 ms; this costs ~0.3 ms).
    """
    ranks = list(job.ranks.values())
    sampled = ranks[:: max(1, len(ranks) // P99_SAMPLE_RANKS)]
    times = sorted(t for rank in sampled for t in rank.steps.step_s)
    if not times:
        return settings.floor_s
    p99 = times[min(len(times) - 1, math.ceil(0.99 * len(times)) - 1)]
    return max(settings.floor_s, settings.p99_factor * p99)


class HangClock(NamedTuple):
    """What a job's hang verdict hangs on, apart from the clock: it is hung once
    ``now - newest_progress_mono_s`` exceeds ``timeout_s``."""

    newest_progress_mono_s: float
    timeout_s: float


def _current_generation(job: JobRecord) -> list[RankRecord]:
    # Only the newest generation: right after torchrun restarted the group,
    # ranks of the old one still show their last steps while the new ones
    # start up, which is no hang.
    return [r for r in job.ranks.values() if r.identity.restart_count == job.restart_count]


def hang_clock(
    job: JobRecord, settings: HangSettings, unreachable_nodes: Collection[str] = ()
) -> HangClock | None:
    """The job's newest progress and its timeout; None when the job is not judged (see detect_hang).

    Changes only with the job's ranks and the set of unreachable nodes, so a
    caller may keep it while neither changed and compare it with the clock.
    """
    ranks = _current_generation(job)
    if not any(r.state == RUNNING for r in ranks):
        return None
    # Progress of the ranks still running, on nodes whose news still arrives: a
    # relaunch of a finished job (same generation, new processes starting up)
    # is judged once they stepped.
    progressed = [
        r.last_progress_mono_s
        for r in ranks
        if r.last_step is not None and r.state == RUNNING and r.node_id not in unreachable_nodes
    ]
    if not progressed:
        return None
    return HangClock(max(progressed), timeout_s(job, settings))


def detect_hang(
    job: JobRecord, now_mono_s: float, settings: HangSettings, unreachable_nodes: Collection[str] = ()
) -> HangFinding | None:
    """A finding if ``job`` is hung at ``now_mono_s`` (coordinator monotonic clock), else None.

    A job none of whose ranks has finished a step yet is not judged: start-up
    (imports, rendezvous, data loading) has no step time to scale with. Nor
    is one with no rank left running: it finished (or failed, which the
    failure detector reports), and nobody waits for anybody. Ranks of an
    older generation (before a restart) are not judged at all, and ranks on
    ``unreachable_nodes`` only through their peers (see the module docstring).
    """
    clock = hang_clock(job, settings, unreachable_nodes)
    if clock is None:
        return None
    stalled_s = now_mono_s - clock.newest_progress_mono_s
    limit_s = clock.timeout_s
    if stalled_s <= limit_s:
        return None
    ranks = _current_generation(job)
    heard = [r for r in ranks if r.node_id not in unreachable_nodes]
    frozen = _frozen(heard, now_mono_s, settings.heartbeat_stale_s)
    silent = {c.rank for c in frozen}
    mismatches = find_mismatches(
        (p for r in heard if r.rank not in silent and (p := position(r)) is not None),
        group_sizes(ranks, job.world_size),
    )
    mismatched = [
        Culprit(o.rank, o.node_id, CulpritReason.COLLECTIVE_MISMATCH, o.detail)
        for m in mismatches
        for o in m.odd
    ]
    culprits = [
        *_exited(ranks),
        *frozen,
        *mismatched,
        *_behind_in_group(heard, mismatches),
        *_unheard(ranks, unreachable_nodes),
    ]
    first_reason: dict[int, Culprit] = {}  # a rank is named once, for its strongest reason
    for culprit in culprits:
        first_reason.setdefault(culprit.rank, culprit)
    unique = tuple(first_reason.values())
    return HangFinding(
        job=job.job,
        stalled_s=stalled_s,
        timeout_s=limit_s,
        last_step=max(r.last_step.step for r in ranks if r.last_step is not None),
        culprits=unique,
        shared_collective=None if unique else _shared_collective(heard),
        mismatches=tuple(mismatches),
    )


def _exited(ranks: list[RankRecord]) -> list[Culprit]:
    return [
        Culprit(r.rank, r.node_id, CulpritReason.EXITED, r.exit.description if r.exit else "exited")
        for r in ranks
        if r.state == EXITED
    ]


def _frozen(ranks: list[RankRecord], now_mono_s: float, stale_s: float) -> list[Culprit]:
    return [
        Culprit(
            r.rank,
            r.node_id,
            CulpritReason.HEARTBEAT_STOPPED,
            f"no heartbeat for {now_mono_s - r.heartbeat_advanced_mono_s:.1f} s",
        )
        for r in ranks
        if r.state != EXITED
        and r.heartbeat is not None
        and now_mono_s - r.heartbeat_advanced_mono_s > stale_s
    ]


def _unheard(ranks: list[RankRecord], unreachable_nodes: Collection[str]) -> list[Culprit]:
    return [
        Culprit(
            r.rank, r.node_id, CulpritReason.NODE_UNREACHABLE, "its node stopped reporting: state unknown"
        )
        for r in ranks
        if r.state != EXITED and r.node_id in unreachable_nodes
    ]


def _behind_in_group(ranks: list[RankRecord], mismatches: Collection[Mismatch]) -> list[Culprit]:
    """Ranks whose Flight Recorder enqueued fewer collectives than the rest of a group.

    In a group with a mismatch, its odd ranks are left out (one that went past
    the others' collective does not make them behind), and so are the ranks
    waiting in one of the group's collectives: they joined it, and the
    mismatch is why it cannot complete (on gloo, the root of a broadcast a
    rank skipped, and the ranks it reached, go on without the others).
    """
    odd: dict[str, set[int]] = {}
    for m in mismatches:
        odd.setdefault(m.group_name, set()).update(o.rank for o in m.odd)
    by_group: dict[str, list[tuple[RankRecord, int]]] = {}
    for rank in ranks:
        if rank.state == EXITED or rank.heartbeat is None:
            continue
        for group in rank.heartbeat.flight_recorder:
            if rank.rank not in odd.get(group.group_name, ()):
                by_group.setdefault(group.group_name, []).append((rank, group.last_enqueued_collective))
    culprits: list[Culprit] = []
    for name, members in sorted(by_group.items()):
        ahead = max(enqueued for _, enqueued in members)
        culprits.extend(
            Culprit(
                rank.rank,
                rank.node_id,
                CulpritReason.BEHIND_IN_GROUP,
                f"enqueued collective {enqueued} of group {name} while its peers reached {ahead}",
            )
            for rank, enqueued in members
            if enqueued < ahead and not (name in odd and _waits_in(rank, name))
        )
    return culprits


def _waits_in(rank: RankRecord, group_name: str) -> bool:
    beat = rank.heartbeat
    return beat is not None and beat.HasField("collective") and beat.collective.group_name == group_name


def _shared_collective(ranks: list[RankRecord]) -> SharedCollective | None:
    waiting = {
        (b.collective.op, b.collective.group_name, b.collective.sequence)
        for r in ranks
        if (b := r.heartbeat) is not None and b.HasField("collective")
    }
    in_collective = sum(1 for r in ranks if r.heartbeat is not None and r.heartbeat.HasField("collective"))
    if len(waiting) != 1 or in_collective != len(ranks):
        return None
    op, group, sequence = waiting.pop()
    return SharedCollective(op, group, sequence)
