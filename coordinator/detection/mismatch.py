"""Collective mismatch: ranks of one process group in different collectives at the same point.

Every rank's hook numbers the collectives it launches per process group and
says, in each heartbeat, which one it is in (op, sequence, size and dtype of
its data; clusterwatch/hook/collectives/ledger.py). Ranks in the same
collective agree on all four, so:

- at the same sequence, a different op, size or dtype (``barrier`` where the
  others ``all_reduce``, a tensor of another size) is another collective;
- at another sequence, while every member of the group waits in one of its
  collectives, the rank passed (or never reached) the collective the others
  wait in: its call there met something else (a zero-size tensor the backend
  completed alone, a skipped or an extra collective silently paired).

Either never resolves by waiting: PyTorch's Flight Recorder analyzer calls it a
collective mismatch. Who is the odd one out, in order:

1. when every member of the group waits in one of its collectives: ranks at
   the same point of the program (step, op, size, dtype) whose sequence
   differs from the majority's there made more or fewer collectives to get
   there (one made alone, one skipped). The others' collective may have
   completed around the odd rank (a broadcast's root, and the ranks it
   reached, go on to the next collective), so comparing ranks at one
   sequence would split them;
2. otherwise, the ranks sorted by what they are in (sequence, op, size,
   dtype): those outside the kind most ranks are in. Sequences are only
   compared when every member waits in the group (else a member that never
   joined explains the rest, coordinator/detection/hangs.py ``behind_in_group``, and a
   root may legitimately finish before its receivers): a rank at another
   sequence then went past the collective the others wait in, or they went
   past its. At equal sequences, a rank in a later step made fewer
   collectives in its steps so far (it skipped one its peers made).

A majority is one kind holding more ranks than any other, and at least two.
With none (a 2-rank group, two halves) nothing tells which side left the
common path: every side is named, saying so.

The hook's sequence numbers count only the collectives it times (see
clusterwatch/hook/collectives/patches.py): a collective one rank calls through a
path the hook does not see (torch.compile, a coalescing manager) while the
others call it where it does would shift that rank's numbers. SPMD programs
call their collectives the same way on every rank, so the numbers agree in
practice.

Pure: a function of the ranks' latest heartbeats, no I/O and no clock.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from clusterwatch.coordinator.model.jobs import RUNNING, RankRecord
from clusterwatch.text.humanize import collective as describe
from clusterwatch.text.humanize import ranks_text
from clusterwatch.v1 import training_pb2


@dataclasses.dataclass(frozen=True)
class Position:
    """Where one rank is: the collective it waits in (or failed in), and its step.

    Attributes:
        step / in_step: ``Heartbeat.step`` and ``Heartbeat.in_step``.
    """

    rank: int
    node_id: str
    collective: training_pb2.CollectiveInFlight
    step: int
    in_step: bool


@dataclasses.dataclass(frozen=True)
class OddRank:
    rank: int
    node_id: str
    detail: str


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One process group whose ranks are in different collectives.

    Attributes:
        sequence: the collective the others are in (with no majority: the
            lowest sequence compared).
        odd: the ranks named, in rank order; every rank compared when there
            is no majority.
        majority: whether a majority pointed them out.
    """

    group_name: str
    sequence: int
    odd: tuple[OddRank, ...]
    majority: bool


def find_mismatches(
    positions: Iterable[Position], group_sizes: Mapping[str, int], *, compare_sequences: bool = True
) -> list[Mismatch]:
    """The groups whose ranks are in different collectives, in group-name order.

    Args:
        positions: one per rank at most: the collective it is in.
        group_sizes: members per group, where known; a group whose positions
            cover all its members may be judged on sequences too.
        compare_sequences: False to compare ranks at the same sequence only
            (positions taken at different times, as the last heartbeats of a
            failed job are).
    """
    by_group: dict[str, list[Position]] = {}
    for position in positions:
        by_group.setdefault(position.collective.group_name, []).append(position)
    found: list[Mismatch] = []
    for group_name in sorted(by_group):
        members = sorted(by_group[group_name], key=lambda p: p.rank)
        if len(members) < 2:
            continue
        if compare_sequences and group_sizes.get(group_name, 0) == len(members):  # the whole group waits
            judged = [_at_program_points(group_name, members) or _judge(group_name, members)]
        else:
            at_sequence: dict[int, list[Position]] = {}
            for position in members:
                at_sequence.setdefault(position.collective.sequence, []).append(position)
            judged = [_judge(group_name, batch) for _, batch in sorted(at_sequence.items()) if len(batch) > 1]
        found.extend(mismatch for mismatch in judged if mismatch is not None)
    return found


def _majority(kinds: Iterable[list[Position]]) -> tuple[list[Position], list[list[Position]]] | None:
    """The kind holding more ranks than any other (and at least two), and the rest; None if none does."""
    ordered = sorted(kinds, key=lambda ranks: (-len(ranks), ranks[0].rank))
    if len(ordered[0]) >= 2 and (len(ordered) == 1 or len(ordered[0]) > len(ordered[1])):
        return ordered[0], ordered[1:]
    return None


def _at_program_points(group_name: str, members: Sequence[Position]) -> Mismatch | None:
    """Ranks at the same point of the program (step, op, size, dtype) at another sequence than most there."""
    points: dict[tuple[int, bool, str, int, str], dict[int, list[Position]]] = {}
    for p in members:
        c = p.collective
        point = points.setdefault((p.step, p.in_step, c.op, c.size_bytes, c.dtype), {})
        point.setdefault(c.sequence, []).append(p)
    odd: list[OddRank] = []
    sequence = 0
    for at_sequence in points.values():
        split = _majority(at_sequence.values()) if len(at_sequence) > 1 else None
        if split is None:
            continue
        majority, others = split
        theirs = majority[0].collective.sequence
        sequence = sequence or theirs
        they = f"{ranks_text(p.rank for p in majority)} {'is' if len(majority) == 1 else 'are'} in #{theirs}"
        for position in (p for kind in others for p in kind):
            more = position.collective.sequence - theirs
            count = f"{abs(more)} collective{'s' if abs(more) > 1 else ''}"
            why = (
                f"it counts {count} more than they do, so it made {count} they did not"
                if more > 0
                else f"it counts {count} fewer than they do, so it skipped {count} they made (it is ahead of them)"
            )
            detail = f"in {describe(position.collective)} of group {group_name} {_when(position)}, where {they}: {why}"
            odd.append(OddRank(position.rank, position.node_id, detail))
    if not odd:
        return None
    odd.sort(key=lambda o: o.rank)
    return Mismatch(group_name, sequence, tuple(odd), majority=True)


def _when(position: Position) -> str:
    return f"in step {position.step}" if position.in_step else f"after step {position.step}"


def position(rank: RankRecord, *, failed: bool = False) -> Position | None:
    """The collective a running rank is in, from its latest heartbeat (None when none).

    With ``failed``, the collective it failed in comes first (a rank whose
    collective raised is no longer in it); exited ranks count too.
    """
    beat = rank.heartbeat
    if beat is None or (rank.state != RUNNING and not failed):
        return None
    if failed and beat.HasField("failed_collective"):
        collective = beat.failed_collective
    elif beat.HasField("collective"):
        collective = beat.collective
    else:
        return None
    return Position(rank.rank, rank.node_id, collective, beat.step, beat.in_step)


def group_sizes(ranks: list[RankRecord], world_size: int) -> dict[str, int]:
    """Members per process group as the ranks report them (WORLD, "0": the world size)."""
    sizes = {"0": world_size}
    for rank in ranks:
        if rank.heartbeat is not None:
            for group in rank.heartbeat.process_groups:
                sizes[group.group_name] = max(sizes.get(group.group_name, 0), group.size)
    return sizes


_Signature = tuple[int, str, int, str]


def _signature(c: training_pb2.CollectiveInFlight) -> _Signature:
    return c.sequence, c.op, c.size_bytes, c.dtype


def _judge(group_name: str, batch: Sequence[Position]) -> Mismatch | None:
    """The odd ones out of ranks of one group (sorted by rank); None when they agree."""
    kinds: dict[_Signature, list[Position]] = collections.defaultdict(list)
    for position in batch:
        kinds[_signature(position.collective)].append(position)
    if len(kinds) == 1:
        return None
    split = _majority(kinds.values())
    if split is not None:
        return _against_majority(group_name, *split)
    return _without_majority(
        group_name, sorted(kinds.values(), key=lambda ranks: (-len(ranks), ranks[0].rank))
    )


def _against_majority(group_name: str, majority: list[Position], others: list[list[Position]]) -> Mismatch:
    reference = majority[0]
    theirs = describe(reference.collective)
    they = ranks_text(p.rank for p in majority)
    steps = collections.Counter(p.step for p in majority if p.in_step)
    common_step = steps.most_common(1)[0][0] if len(steps) == 1 else None
    odd = []
    for kind in others:
        for position in kind:
            detail = (
                f"in {describe(position.collective)} of group {group_name} while {they} "
                f"{'is' if len(majority) == 1 else 'are'} in {theirs}"
                f"{_relation(position, reference.collective.sequence, common_step)}"
            )
            odd.append(OddRank(position.rank, position.node_id, detail))
    odd.sort(key=lambda o: o.rank)
    return Mismatch(group_name, reference.collective.sequence, tuple(odd), majority=True)


def _relation(position: Position, sequence: int, their_step: int | None) -> str:
    """What the rank's sequence or step says about where it is, against the majority's."""
    ahead = position.collective.sequence - sequence
    if ahead:
        count = abs(ahead)
        noun = "collective" if count == 1 else "collectives"
        if ahead > 0:
            return f": {count} {noun} ahead of them (it went past the one they wait in)"
        return f": {count} {noun} behind them (they went past the one it waits in)"
    if their_step is None or not position.in_step or position.step == their_step:
        return ""
    if position.step > their_step:
        return (
            f": in step {position.step} while they are in step {their_step} at the same collective number, "
            "so it is ahead of them: it skipped a collective they made"
        )
    return (
        f": in step {position.step} while they are in step {their_step} at the same collective number, "
        "so it made a collective they did not"
    )


def _without_majority(group_name: str, kinds: list[list[Position]]) -> Mismatch:
    sides = [f"{ranks_text(p.rank for p in kind)} in {describe(kind[0].collective)}" for kind in kinds]
    odd = []
    for index, kind in enumerate(kinds):
        rest = "; ".join(side for other, side in enumerate(sides) if other != index)
        for position in kind:
            detail = (
                f"in {describe(position.collective)} of group {group_name} while {rest}: "
                "no majority tells which side left the common path"
            )
            odd.append(OddRank(position.rank, position.node_id, detail))
    odd.sort(key=lambda o: o.rank)
    sequence = min(kind[0].collective.sequence for kind in kinds)
    return Mismatch(group_name, sequence, tuple(odd), majority=False)
