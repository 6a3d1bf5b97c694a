"""The synthetic training job: a synchronous data-parallel loop, rank by rank, in wall time.

Every step of every rank is compute followed by one all-reduce (one Flight
Recorder collective per step in process group "0", sequence = step number):

    rank i starts step k at s_i(k) (when it left the previous collective),
    computes until a_i(k) = s_i(k) + c_i(k), then waits in the all-reduce;
    the all-reduce completes when the last rank has arrived plus the transfer
    time: e_i(k) = max_j a_j(k) + T(k) + a small per-rank finish jitter;
    s_i(k+1) = e_i(k).

So every rank's step time is about the same, the communication time of a
rank is its wait for the slowest rank plus T (the straggler's is the
smallest), and compute time is what tells a straggler apart: exactly what a
real synchronous job shows (docs/SIGNALS.md).

Faults change the model from their step on: slowdowns multiply c_i (or T, for
a slow link); stopping faults make a rank never reach the all-reduce of
their step (a_i = inf), so the others enqueue it and wait there forever:

    hang      the rank stays in its step, heartbeats go on, FR enqueued stays behind
    frozen    the whole process stops halfway through its compute: heartbeats stop too
    crash     the process dies halfway through its compute: EXITED with the signal
    node_loss the node's ranks stop with it (its agent goes silent)

Reports are built the way the agent builds them (agent/ranks.py): per rank,
the steps finished since the node's previous report, the latest heartbeat,
the collectives of those steps merged, the state, and the exit once.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import enum
import math
import signal
import uuid
from collections.abc import Collection, Sequence

from clusterwatch.sim.noise import NoiseModel
from clusterwatch.sim.scenario import FaultKind, FaultSpec, Scenario, affected_ranks
from clusterwatch.v1 import training_pb2
from clusterwatch.wire.collective_stats import (
    COLLECTIVE_DURATION_BUCKETS_S,
    bus_bandwidth_bytes_per_s,
    bus_factor,
    size_bucket_bytes,
)

FIRST_STEP = 1
GROUP_NAME = "0"
OP = "all_reduce"
DTYPE = "bfloat16"
# What the gradient all-reduce reaches on a healthy fabric (nccl-tests busbw,
# 400 Gb/s NDR per GPU); sets the gradient size from the nominal transfer time.
NOMINAL_BUS_BANDWIDTH_BYTES_PER_S = 40e9
SAMPLES_PER_STEP = 8
TOKENS_PER_SAMPLE = 4096
# Where in its compute a frozen, crashed or lost rank stops (hang: at its end).
STOP_AT_COMPUTE_FRACTION = 0.5
HOOK_VERSION = "sim"
_BUCKETS = len(COLLECTIVE_DURATION_BUCKETS_S) + 1
RUNNING = training_pb2.RankState.RANK_STATE_RUNNING
EXITED = training_pb2.RankState.RANK_STATE_EXITED


class StopKind(enum.Enum):
    """How a stopping fault ends a rank (see the module docstring)."""

    HUNG = "hung"
    FROZEN = "frozen"
    EXITED = "exited"
    LOST = "lost"


_STOP_OF_FAULT = {
    FaultKind.HANG: StopKind.HUNG,
    FaultKind.FROZEN: StopKind.FROZEN,
    FaultKind.CRASH: StopKind.EXITED,
    FaultKind.NODE_LOSS: StopKind.LOST,
}


class RankCondition(enum.Enum):
    """What one rank's process is doing at one moment (for GPUs and diagnoses)."""

    COMPUTING = "computing"
    IN_COLLECTIVE = "in_collective"
    # In a collective that has lasted longer than a step should (the job is stuck).
    WAITING = "waiting"
    HUNG = "hung"
    FROZEN = "frozen"
    EXITED = "exited"
    LOST = "lost"


@dataclasses.dataclass(frozen=True, slots=True)
class Stop:
    step: int
    kind: StopKind
    fault_index: int
    signal: int = 0

    @property
    def compute_fraction(self) -> float:
        return 1.0 if self.kind is StopKind.HUNG else STOP_AT_COMPUTE_FRACTION


@dataclasses.dataclass(frozen=True, slots=True)
class Onset:
    """When a fault took effect: wall time and the step it hit."""

    unix_s: float
    step: int


class Step:
    """One step of every rank: per-rank start, compute end and end wall times (inf: never)."""

    __slots__ = ("compute_end_s", "end_s", "first_end_s", "number", "start_s")

    def __init__(
        self, number: int, start_s: list[float], compute_end_s: list[float], end_s: list[float]
    ) -> None:
        self.number = number
        self.start_s = start_s
        self.compute_end_s = compute_end_s
        self.end_s = end_s
        self.first_end_s = min(end_s)


@dataclasses.dataclass(slots=True)
class NodeRanks:
    """What one node report carries about the node's ranks.

    Attributes:
        reports: one RankReport per rank still known to the agent.
        conditions: per local GPU, what its rank does now (None: no rank on it any more).
        steps_done: steps the node's ranks finished since its previous report.
    """

    reports: list[training_pb2.RankReport]
    conditions: list[RankCondition | None]
    steps_done: int


class JobModel:
    """One synchronous job of ``len(node_ids) x gpus_per_node`` ranks.

    Args:
        job: the job's name.
        node_ids: the nodes, in rank order (node j hosts ranks j*G .. j*G+G-1).
        gpus_per_node: G.
        step_s: nominal step time.
        scenario: noise and faults.
        start_unix_s: when step 1 starts on every rank.
        seed: seeds the noise (default: the scenario's).
        gpu_uuids: per node, the UUIDs of its GPUs (rank identity's gpu_uuid).
    """

    def __init__(
        self,
        job: str,
        node_ids: Sequence[str],
        gpus_per_node: int,
        step_s: float,
        scenario: Scenario,
        *,
        start_unix_s: float,
        gpu_uuids: Sequence[Sequence[str]],
        seed: int | None = None,
    ) -> None:
        self.job = job
        self.node_ids = tuple(node_ids)
        self.gpus_per_node = gpus_per_node
        self.world_size = n = len(node_ids) * gpus_per_node
        self.start_unix_s = start_unix_s
        self.step_s = step_s
        self.noise = NoiseModel(scenario.noise, n, scenario.seed if seed is None else seed)
        self.base_compute_s = step_s * (1.0 - scenario.comm_fraction)
        self.base_transfer_s = step_s * scenario.comm_fraction
        self.bus_factor = bus_factor(OP, n)
        self.allreduce_bytes = int(
            NOMINAL_BUS_BANDWIDTH_BYTES_PER_S * self.base_transfer_s / (self.bus_factor or 1.0)
        )
        self._size_bucket = size_bucket_bytes(self.allreduce_bytes)
        self._identities = [self._identity(rank, gpu_uuids) for rank in range(n)]
        self._compute_slowdowns: list[tuple[int, tuple[int, ...], float]] = []
        self._network_slowdowns: list[tuple[int, float]] = []
        self._stops: dict[int, Stop] = {}
        self._faults = scenario.faults
        for fault in scenario.faults:
            self._add_fault(fault)
        self.onsets: dict[int, Onset] = {}
        self.stop_events_s: dict[int, float] = {}
        # Job-wide: when the first rank finished each step (index 0 is FIRST_STEP).
        self.step_ends_unix_s: list[float] = []
        self.stalled_at_step: int | None = None
        self._steps: collections.deque[Step] = collections.deque()
        self._reported_through = [FIRST_STEP - 1] * n
        self._retired: set[int] = set()
        self._generate()

    # --- the model ------------------------------------------------------------------------

    def _add_fault(self, fault: FaultSpec) -> None:
        ranks = affected_ranks(fault, self.gpus_per_node)
        if fault.kind is FaultKind.NETWORK_STRAGGLER:
            self._network_slowdowns.append((fault.at_step, fault.slowdown_ratio))
        elif fault.kind in _STOP_OF_FAULT:
            for rank in ranks:
                stop = Stop(fault.at_step, _STOP_OF_FAULT[fault.kind], fault.index, fault.signal)
                current = self._stops.get(rank)
                if current is None or stop.step < current.step:
                    self._stops[rank] = stop
        else:
            self._compute_slowdowns.append((fault.at_step, ranks, fault.slowdown_ratio))

    def advance(self, now_unix_s: float) -> None:
        """Generate every step some rank has started by ``now_unix_s``."""
        while self.stalled_at_step is None and self._steps[-1].first_end_s <= now_unix_s:
            self._generate()

    def _generate(self) -> None:
        n = self.world_size
        previous = self._steps[-1] if self._steps else None
        number = previous.number + 1 if previous is not None else FIRST_STEP
        starts = list(previous.end_s) if previous is not None else [self.start_unix_s] * n
        if previous is not None:
            self.step_ends_unix_s.append(previous.first_end_s)
        first_start = min(starts)
        compute = self.noise.compute_s(
            self.base_compute_s * self.noise.drift(first_start - self.start_unix_s)
        )
        for at_step, slowed, ratio in self._compute_slowdowns:
            if number >= at_step:
                for rank in slowed:
                    compute[rank] *= ratio
        compute_end = [s + c for s, c in zip(starts, compute, strict=True)]
        for rank, stop in self._stops.items():
            if stop.step == number:
                event_s = starts[rank] + stop.compute_fraction * compute[rank]
                self.stop_events_s[rank] = event_s
                compute_end[rank] = math.inf
                self._onset(stop.fault_index, event_s, number)
        for fault in self._faults:
            if fault.at_step == number and fault.kind not in _STOP_OF_FAULT:
                hit: Sequence[int] = (
                    range(n)
                    if fault.kind is FaultKind.NETWORK_STRAGGLER
                    else affected_ranks(fault, self.gpus_per_node)
                )
                self._onset(fault.index, min(starts[r] for r in hit), number)
        barrier_s = max(compute_end)
        if math.isinf(barrier_s):
            end = [math.inf] * n
            self.stalled_at_step = number
        else:
            transfer_s = self.base_transfer_s * self.noise.transfer_factor()
            for at_step, ratio in self._network_slowdowns:
                if number >= at_step:
                    transfer_s *= ratio
            done_s = barrier_s + transfer_s
            end = [done_s + jitter for jitter in self.noise.finish_jitter_s(n)]
        self._steps.append(Step(number, starts, compute_end, end))

    def _onset(self, fault_index: int, unix_s: float, step: int) -> None:
        known = self.onsets.get(fault_index)
        if known is None or unix_s < known.unix_s:
            self.onsets[fault_index] = Onset(unix_s, step)

    def prune(self) -> None:
        """Forget steps every rank still reported has been reported past."""
        active = [r for i, r in enumerate(self._reported_through) if i not in self._retired]
        oldest = min(active) if active else math.inf
        steps = self._steps
        while len(steps) > 1 and steps[0].number <= oldest:
            steps.popleft()

    # --- what one rank looks like --------------------------------------------------------

    def _step_at(self, rank: int, at_s: float) -> Step:
        """The step ``rank`` is in at ``at_s`` (the newest generated one at most)."""
        steps = self._steps
        index = max(0, self._reported_through[rank] + 1 - steps[0].number)
        last = len(steps) - 1
        while index < last and steps[index].end_s[rank] <= at_s:
            index += 1
        return steps[index]

    def stopped(self, rank: int, at_s: float) -> StopKind | None:
        """How ``rank`` has stopped by ``at_s``, or None while it runs."""
        event_s = self.stop_events_s.get(rank)
        if event_s is None or at_s < event_s:
            return None
        return self._stops[rank].kind

    def condition(self, rank: int, at_s: float) -> RankCondition:
        stop = self.stopped(rank, at_s)
        if stop is not None:
            return RankCondition(stop.value)
        step = self._step_at(rank, at_s)
        if at_s < step.compute_end_s[rank]:
            return RankCondition.COMPUTING
        if at_s - step.compute_end_s[rank] > 2 * self.step_s + 1.0:
            return RankCondition.WAITING
        return RankCondition.IN_COLLECTIVE

    def heartbeat(self, rank: int, at_s: float) -> training_pb2.Heartbeat:
        """The hook's heartbeat at ``at_s``: step, in-flight collective, Flight Recorder status."""
        step = self._step_at(rank, at_s)
        number = step.number
        beat = training_pb2.Heartbeat(
            timestamp_unix_seconds=at_s,
            step=number,
            in_step=True,
            step_elapsed_seconds=max(0.0, at_s - step.start_s[rank]),
            steps_completed_total=number - FIRST_STEP,
            flight_recorder_enabled=True,
        )
        compute_end_s = step.compute_end_s[rank]
        enqueued = number if compute_end_s <= at_s else number - 1
        if compute_end_s <= at_s:
            beat.collective.op = OP
            beat.collective.group_name = GROUP_NAME
            beat.collective.sequence = number
            beat.collective.started_unix_seconds = compute_end_s
            beat.collective.elapsed_seconds = at_s - compute_end_s
            beat.collective.blocking = True
        completed = number - 1
        beat.flight_recorder.add(
            group_name=GROUP_NAME,
            last_enqueued_collective=_fr_sequence(enqueued),
            last_started_collective=_fr_sequence(enqueued),
            last_completed_collective=_fr_sequence(completed),
        )
        return beat

    # --- node reports ----------------------------------------------------------------------

    def node_ranks(self, node: int, now_s: float) -> NodeRanks:
        """The ranks of ``node`` for its report at ``now_s``; moves their reported steps on."""
        g = self.gpus_per_node
        reports: list[training_pb2.RankReport] = []
        conditions: list[RankCondition | None] = []
        steps_done = 0
        for rank in range(node * g, node * g + g):
            if rank in self._retired:
                conditions.append(None)
                continue
            stop = self.stopped(rank, now_s)
            if stop is StopKind.LOST:
                conditions.append(RankCondition.LOST)
                continue
            as_of_s = self.stop_events_s[rank] if stop in (StopKind.FROZEN, StopKind.EXITED) else now_s
            report = training_pb2.RankReport(identity=self._identities[rank], state=RUNNING)
            steps_done = max(steps_done, self._add_steps(report, rank, as_of_s))
            report.heartbeat.CopyFrom(self.heartbeat(rank, as_of_s))
            if stop is StopKind.EXITED:
                report.state = EXITED
                report.exit.CopyFrom(_killed(self._stops[rank].signal, as_of_s))
                self._retired.add(rank)
            conditions.append(self.condition(rank, now_s))
            reports.append(report)
        return NodeRanks(reports, conditions, steps_done)

    def _add_steps(self, report: training_pb2.RankReport, rank: int, as_of_s: float) -> int:
        """Add the rank's steps finished by ``as_of_s`` and not reported yet, with their collective."""
        steps = self._steps
        index = self._reported_through[rank] + 1 - steps[0].number
        count = 0
        comm_total_s = comm_max_s = 0.0
        buckets = [0] * _BUCKETS
        add = report.steps.add
        while index < len(steps):
            step = steps[index]
            end_s = step.end_s[rank]
            if end_s > as_of_s:
                break
            start_s = step.start_s[rank]
            compute_end_s = step.compute_end_s[rank]
            comm_s = end_s - compute_end_s
            add(
                step=step.number,
                start_unix_seconds=start_s,
                step_seconds=end_s - start_s,
                communication_seconds=comm_s,
                compute_seconds=compute_end_s - start_s,
                samples=SAMPLES_PER_STEP,
                tokens=SAMPLES_PER_STEP * TOKENS_PER_SAMPLE,
            )
            comm_total_s += comm_s
            comm_max_s = max(comm_max_s, comm_s)
            buckets[bisect.bisect_left(COLLECTIVE_DURATION_BUCKETS_S, comm_s)] += 1
            count += 1
            index += 1
        if count:
            last = steps[index - 1].number
            self._reported_through[rank] = last
            bytes_total = count * self.allreduce_bytes
            report.collectives.add(
                op=OP,
                group_name=GROUP_NAME,
                group_size=self.world_size,
                dtype=DTYPE,
                size_bucket_bytes=self._size_bucket,
                count=count,
                bytes_total=bytes_total,
                duration_seconds_total=comm_total_s,
                duration_seconds_max=comm_max_s,
                last_sequence=last,
                bus_bandwidth_bytes_per_second=bus_bandwidth_bytes_per_s(
                    OP, self.world_size, bytes_total, comm_total_s
                ),
                duration_bucket_counts=buckets,
            )
        return count

    def final_ranks(self, node: int, now_s: float) -> list[training_pb2.RankReport]:
        """The end of the run: running ranks of ``node`` exit cleanly, hung and frozen ones are
        terminated (SIGTERM, as torchrun stops a worker group)."""
        reports = []
        for rank in range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node):
            stop = self.stopped(rank, now_s)
            if rank in self._retired or stop in (StopKind.EXITED, StopKind.LOST):
                continue
            as_of_s = self.stop_events_s[rank] if stop is StopKind.FROZEN else now_s
            report = training_pb2.RankReport(identity=self._identities[rank], state=EXITED)
            report.heartbeat.CopyFrom(self.heartbeat(rank, as_of_s))
            if stop is None:
                report.exit.CopyFrom(
                    training_pb2.RankExit(
                        timestamp_unix_seconds=now_s, exit_code=0, clean=True, description="exit code 0"
                    )
                )
            else:
                report.exit.CopyFrom(_killed(signal.SIGTERM, now_s))
            self._retired.add(rank)
            reports.append(report)
        return reports

    def reported_by_every_rank(self, lost_nodes: Collection[int] = ()) -> int:
        """The newest step that every rank still reporting (not exited, not on a lost node) has
        reported (FIRST_STEP - 1 before any): the coordinator can compare ranks at it from then on."""
        if not self._retired and not lost_nodes:
            return min(self._reported_through)
        g = self.gpus_per_node
        return min(
            (
                through
                for rank, through in enumerate(self._reported_through)
                if rank not in self._retired and rank // g not in lost_nodes
            ),
            default=FIRST_STEP - 1,
        )

    def last_step_done(self) -> int:
        """The newest step some rank finished (FIRST_STEP - 1 before any)."""
        return FIRST_STEP - 1 + len(self.step_ends_unix_s)

    def _identity(self, rank: int, gpu_uuids: Sequence[Sequence[str]]) -> training_pb2.RankIdentity:
        node, local_rank = divmod(rank, self.gpus_per_node)
        return training_pb2.RankIdentity(
            job=self.job,
            rank=rank,
            local_rank=local_rank,
            world_size=self.world_size,
            pid=10_000 + local_rank,
            hostname=self.node_ids[node],
            restart_count=0,
            gpu_uuid=gpu_uuids[node][local_rank],
            hook_version=HOOK_VERSION,
            instance_id=uuid.uuid4().hex,
            backend="nccl",
        )


def _fr_sequence(sequence: int) -> int:
    """Flight Recorder sequences count from FIRST_STEP; -1 means none yet."""
    return sequence if sequence >= FIRST_STEP else -1


def _killed(signal_number: int, at_s: float) -> training_pb2.RankExit:
    try:
        name = f" ({signal.Signals(signal_number).name})"
    except ValueError:
        name = ""
    return training_pb2.RankExit(
        timestamp_unix_seconds=at_s,
        signal=signal_number,
        clean=False,
        description=f"killed by signal {signal_number}{name}",
    )
