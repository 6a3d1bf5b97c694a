"""The training processes registered with this node's agent, and what they reported.

One entry per process (keyed by the hook's ``instance_id``). Hook streams
feed it; every node report drains it (steps and checkpoint results since the
previous report, the latest heartbeat, exits). Runs on the agent's event
loop only; the exit watcher is its one link to the operating system.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
from collections.abc import Iterable

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from clusterwatch.agent.hook_limits import (
    MAX_COLLECTIVE_KINDS,
    MAX_RANKS,
    MAX_RANKS_PER_PROCESS,
    MAX_RANKS_PER_UID,
    HookLimitError,
)
from clusterwatch.agent.hook_validation import (
    InvalidHookMessageError,
    RankGoneError,
    check_batch,
    check_identity,
    check_process_groups,
    check_values,
)
from clusterwatch.agent.proc_exit import ExitStatus, ExitWatcher
from clusterwatch.agent.process_instance import ProcessInstance, VerifiedProcess
from clusterwatch.v1 import training_pb2
from clusterwatch.wire.collective_stats import CollectiveMerger

logger = logging.getLogger(__name__)

# A hook sends one result per checkpoint request; more than this between two
# reports is a misbehaving hook, and the oldest results go.
MAX_CHECKPOINT_RESULTS_PER_REPORT = 64


class RankState(enum.Enum):
    """Lifecycle of one training process as the agent sees it.

    Transitions::

        hello                          -> RUNNING
        RUNNING      -- stream ends    -> DISCONNECTED  (the process still runs)
        DISCONNECTED -- same instance says hello again -> RUNNING
        RUNNING | DISCONNECTED -- process exit seen -> EXITED
        EXITED       -- carried by one node report -> removed
    """

    RUNNING = training_pb2.RANK_STATE_RUNNING
    DISCONNECTED = training_pb2.RANK_STATE_DISCONNECTED
    EXITED = training_pb2.RANK_STATE_EXITED


@dataclasses.dataclass(slots=True)
class RankEntry:
    """One registered training process.

    Attributes:
        identity: from the hello, replaced by identity updates.
        state: see RankState.
        stream: generation of the hook stream that owns the entry (a reconnect bumps it).
        heartbeat: the latest one, or None before the first.
        steps: step summaries not yet in a node report, oldest first (bounded; newest kept).
        steps_dropped_total: summaries pushed out of ``steps`` before a report took them.
        collectives: the collectives of every step since the last report, merged.
        checkpoint_results: results not yet in a node report.
        said_goodbye: the hook announced a clean interpreter exit.
        stopped_for: why clusterwatch stopped the process (a restart), "" if it did not:
            its exit is then expected, not a rank failure.
        exit: how the process ended, once EXITED.
        pending_exit: an exit seen while the stream was still open (see RankRegistry.report_into).
        retire_after_report: a newer hook in the same process replaced this one.
        uid: the user the process runs as, as the kernel reported it; None if not verified.
        start_ticks: when the process started (agent/process_instance.py); None if not verified.
        slurm_job_id: the SLURM job whose cgroup holds the process (agent/slurm_cgroup.py); "" if none.
        launcher: the process that launched it (its parent when it registered); None if none or unknown.
        launcher_exit: how the launcher ended, once it did while this process runs (an orphan).
    """

    identity: training_pb2.RankIdentity
    steps: collections.deque[training_pb2.StepSummary]
    state: RankState = RankState.RUNNING
    stream: int = 1
    heartbeat: training_pb2.Heartbeat | None = None
    steps_dropped_total: int = 0
    checkpoint_results: collections.deque[training_pb2.CheckpointResult] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=MAX_CHECKPOINT_RESULTS_PER_REPORT)
    )
    collectives: CollectiveMerger = dataclasses.field(
        default_factory=lambda: CollectiveMerger(max_kinds=MAX_COLLECTIVE_KINDS)
    )
    said_goodbye: bool = False
    stopped_for: str = ""
    exit: training_pb2.RankExit | None = None
    pending_exit: ExitStatus | None = None
    retire_after_report: bool = False
    uid: int | None = None
    start_ticks: int | None = None
    slurm_job_id: str = ""
    launcher: ProcessInstance | None = None
    launcher_exit: training_pb2.LauncherExit | None = None

    @property
    def instance_id(self) -> str:
        return self.identity.instance_id

    @property
    def orphaned(self) -> bool:
        """Its launcher ended while it runs (and nobody is stopping it on purpose)."""
        return (
            self.launcher_exit is not None
            and self.state is not RankState.EXITED
            and self.pending_exit is None
            and not self.stopped_for
        )

    @property
    def pid(self) -> int:
        return self.identity.pid


class RankRegistry:
    """The training processes on this node and their reports-in-waiting.

    Args:
        max_steps_per_report: per rank, step summaries kept between two reports (newest kept).
        exit_watcher: tells which registered pids exited.
    """

    def __init__(self, max_steps_per_report: int, exit_watcher: ExitWatcher) -> None:
        if max_steps_per_report < 1:
            raise ValueError(f"max_steps_per_report must be at least 1, got {max_steps_per_report}")
        self.max_steps_per_report = max_steps_per_report
        self._watcher = exit_watcher
        self._entries: dict[str, RankEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, instance_id: str) -> RankEntry | None:
        return self._entries.get(instance_id)

    def entries(self) -> list[RankEntry]:
        """Every entry, ordered by job, rank and instance."""
        return sorted(self._entries.values(), key=lambda e: (e.identity.job, e.identity.rank, e.instance_id))

    def pid_of(self, job: str, rank: int) -> int | None:
        """The pid of the registered process running ``rank`` of ``job``, if it may still run.

        Exited processes (and those whose exit is pending) are left out: their
        pid may already belong to another process. A RUNNING entry wins over a
        DISCONNECTED one (its hook stream ended, the process may still run),
        and the newest registration over older ones.
        """
        candidates = [
            entry
            for entry in self._entries.values()  # in registration order
            if entry.identity.job == job
            and entry.identity.rank == rank
            and entry.state is not RankState.EXITED
            and entry.pending_exit is None
        ]
        if not candidates:
            return None
        running = [entry for entry in candidates if entry.state is RankState.RUNNING]
        return (running or candidates)[-1].pid

    def mark_stopping(self, pids: Iterable[int], why: str) -> None:
        """These processes are being stopped on purpose: their exits are reported as clean."""
        stopping = set(pids)
        for entry in self._entries.values():
            if entry.pid in stopping:
                entry.stopped_for = why

    def worker_pids(self, job: str) -> dict[int, int]:
        """Every registered process of ``job`` that may still run, as {pid: rank}, by rank.

        Same rule as ``pid_of`` for exits, but every such process counts, not
        one per rank: an older registration of a rank whose process still runs
        is one more worker to stop.
        """
        entries = sorted(
            (
                entry
                for entry in self._entries.values()
                if entry.identity.job == job
                and entry.state is not RankState.EXITED
                and entry.pending_exit is None
            ),
            key=lambda entry: entry.identity.rank,
        )
        return {entry.pid: entry.identity.rank for entry in entries}

    def instances(self, pids: Iterable[int]) -> dict[int, ProcessInstance]:
        """The verified process (pid, start time, uid) behind each of ``pids`` that has one.

        A stop checks each pid against it before signalling: the pid may belong to another
        process by then.
        """
        wanted = set(pids)
        return {
            entry.pid: ProcessInstance(entry.pid, entry.start_ticks, entry.uid)
            for entry in self._entries.values()
            if entry.pid in wanted
            and entry.start_ticks is not None
            and entry.uid is not None
            and entry.state is not RankState.EXITED
        }

    def count_by_state(self) -> dict[RankState, int]:
        counts = dict.fromkeys(RankState, 0)
        for entry in self._entries.values():
            counts[entry.state] += 1
        return counts

    # --- what hook streams call ---------------------------------------------

    def hello(self, identity: training_pb2.RankIdentity, verified: VerifiedProcess | None = None) -> int:
        """Register a process, or re-attach a known one whose hook reconnected.

        Args:
            identity: from the hello, its pid verified by the caller.
            verified: what the kernel says of the process; None if not verified.

        Returns:
            The stream generation to pass to ``disconnect``.

        Raises:
            InvalidHookMessageError: a bad identity, or a known instance claiming another pid.
            RankGoneError: the instance was already reported as exited.
            HookLimitError: a new registration past agent/hook_limits.py's limits.
        """
        check_identity(identity, "hello")
        entry = self._entries.get(identity.instance_id)
        if entry is None:
            for other in self._entries.values():
                if other.pid == identity.pid and other.state is RankState.DISCONNECTED:
                    # A new hook in the same process (a second TrainingMonitor): the old one is done.
                    other.retire_after_report = True
            uid = verified.uid if verified is not None else None
            self._check_room(identity.pid, uid)
            entry = self._entries[identity.instance_id] = RankEntry(
                identity, collections.deque(maxlen=self.max_steps_per_report), uid=uid
            )
            if verified is not None:
                entry.start_ticks, entry.slurm_job_id = verified.start_ticks, verified.slurm_job_id
                entry.launcher = verified.launcher
            self._watcher.watch(identity.pid)
            if entry.launcher is not None:
                self._watcher.watch(entry.launcher.pid)
            logger.info(
                "rank %d of job %s registered (pid %d, uid %s, instance %s)",
                identity.rank,
                identity.job,
                identity.pid,
                "unverified" if uid is None else uid,
                identity.instance_id,
            )
            return entry.stream
        if entry.state is RankState.EXITED:
            description = entry.exit.description if entry.exit is not None else "exited"
            raise RankGoneError(f"instance {identity.instance_id} already ended: {description}")
        self._check_same_process(entry, identity, "hello")
        start_ticks = verified.start_ticks if verified is not None else None
        if None not in (start_ticks, entry.start_ticks) and start_ticks != entry.start_ticks:
            raise InvalidHookMessageError(
                "hello.instance_id",
                f"{identity.instance_id} belongs to another process (same pid, started earlier)",
            )
        self._replace_identity(entry, identity)
        if verified is not None:
            entry.uid = verified.uid
        entry.state = RankState.RUNNING
        entry.stream += 1
        return entry.stream

    def _check_room(self, pid: int, uid: int | None) -> None:
        """Refuse a new registration past agent/hook_limits.py's rank limits.

        Raises:
            HookLimitError: naming the limit.
        """
        live = [
            e for e in self._entries.values() if e.state is not RankState.EXITED and not e.retire_after_report
        ]
        for count, limit, whose in (
            (sum(e.pid == pid for e in live), MAX_RANKS_PER_PROCESS, f"process {pid}"),
            (sum(e.uid == uid for e in live) if uid is not None else 0, MAX_RANKS_PER_UID, f"user {uid}"),
            (len(live), MAX_RANKS, "this node"),
        ):
            if count >= limit:
                raise HookLimitError(
                    f"hello: {whose} has {count} live ranks registered already, the most allowed"
                )

    def update_identity(self, instance_id: str, identity: training_pb2.RankIdentity) -> None:
        """Replace a process's identity (its backend or GPU became known)."""
        entry = self._require(instance_id)
        check_identity(identity, "identity")
        self._check_same_process(entry, identity, "identity")
        self._replace_identity(entry, identity)

    def add_steps(self, instance_id: str, steps: Iterable[training_pb2.StepSummary]) -> None:
        """Queue step summaries for the next report; all are checked before any is kept."""
        entry = self._require(instance_id)
        batch = list(steps)
        check_batch(batch)
        for index, step in enumerate(batch):
            check_values(step, f"steps[{index}]")
        room = entry.steps.maxlen or 0
        overflow = len(entry.steps) + len(batch) - room
        if overflow > 0:
            entry.steps_dropped_total += overflow  # the deque keeps the newest
        for step in batch:  # collectives are counted even when their step is dropped
            for summary in step.collectives:
                entry.collectives.add(summary)
            del step.collectives[:]
        entry.steps.extend(batch)

    def heartbeat(self, instance_id: str, heartbeat: training_pb2.Heartbeat) -> None:
        entry = self._require(instance_id)
        check_values(heartbeat, "heartbeat")
        check_process_groups(heartbeat, entry.identity)
        entry.heartbeat = heartbeat

    def checkpoint_result(self, instance_id: str, result: training_pb2.CheckpointResult) -> None:
        entry = self._require(instance_id)
        check_values(result, "checkpoint_result")
        entry.checkpoint_results.append(result)

    def goodbye(self, instance_id: str) -> None:
        """The hook's interpreter is exiting normally: its exit will be marked clean."""
        self._require(instance_id).said_goodbye = True

    def disconnect(self, instance_id: str, stream: int) -> None:
        """The stream of generation ``stream`` ended; a newer stream of the same instance is unaffected."""
        entry = self._entries.get(instance_id)
        if entry is not None and entry.stream == stream and entry.state is RankState.RUNNING:
            entry.state = RankState.DISCONNECTED
            if entry.pending_exit is not None:  # the exit was only waiting for the stream to drain
                self._mark_exited(entry, entry.pending_exit)

    # --- what each node report calls ----------------------------------------

    def report_into(self, ranks: RepeatedCompositeFieldContainer[training_pb2.RankReport]) -> None:
        """Append one RankReport per entry and start the next interval.

        Steps and checkpoint results move into the report; exited entries are
        reported once and then forgotten. An exit seen while the hook's stream
        is still open waits until the stream ends (at most one more report),
        so the last steps and the goodbye, already on their way through the
        socket, are not lost behind it.
        """
        self._apply_exits(self._watcher.take_exits())
        gone: list[RankEntry] = []
        for entry in self.entries():
            report = ranks.add()
            report.identity.CopyFrom(entry.identity)
            report.state = entry.state.value
            if entry.uid is not None:
                report.uid = entry.uid
            report.slurm_job_id = entry.slurm_job_id
            if entry.launcher_exit is not None and entry.orphaned:
                report.launcher_exit.CopyFrom(entry.launcher_exit)
            if entry.heartbeat is not None:
                report.heartbeat.CopyFrom(entry.heartbeat)
            if entry.steps:
                report.steps.extend(entry.steps)
                entry.steps.clear()
            report.steps_dropped_total = entry.steps_dropped_total
            if entry.collectives:
                report.collectives.extend(entry.collectives.take())
            if entry.checkpoint_results:
                report.checkpoint_results.extend(entry.checkpoint_results)
                entry.checkpoint_results.clear()
            if entry.exit is not None:
                report.exit.CopyFrom(entry.exit)
            if entry.state is RankState.EXITED or entry.retire_after_report:
                gone.append(entry)
        for entry in gone:
            del self._entries[entry.instance_id]
            if not any(other.pid == entry.pid for other in self._entries.values()):
                self._watcher.unwatch(entry.pid)
            launcher = entry.launcher
            if launcher is not None and not any(o.launcher == launcher for o in self._entries.values()):
                self._watcher.unwatch(launcher.pid)

    def _apply_exits(self, exits: dict[int, ExitStatus]) -> None:
        for entry in self._entries.values():
            status = exits.get(entry.pid) or entry.pending_exit
            if status is None or entry.state is RankState.EXITED:
                continue
            if entry.state is RankState.RUNNING and entry.pending_exit is None:
                entry.pending_exit = status  # the stream is still open: one report's grace
                continue
            self._mark_exited(entry, status)
        # After the ranks' own exits: a launcher ending after its workers (a job's normal end) orphans none.
        for entry in self._entries.values():
            launcher = entry.launcher
            if launcher is None or entry.launcher_exit is not None or launcher.pid not in exits:
                continue
            ended = exits[launcher.pid]
            entry.launcher_exit = training_pb2.LauncherExit(
                launcher_pid=launcher.pid,
                launcher_name=launcher.name,
                description=ended.description,
                timestamp_unix_seconds=ended.timestamp_unix_s,
            )
            if entry.orphaned:
                logger.warning(
                    "rank %d of job %s (pid %d) runs on without its launcher %s (pid %d): %s",
                    entry.identity.rank,
                    entry.identity.job,
                    entry.pid,
                    launcher.name,
                    launcher.pid,
                    ended.description,
                )

    @staticmethod
    def _mark_exited(entry: RankEntry, status: ExitStatus) -> None:
        entry.pending_exit = None
        entry.state = RankState.EXITED
        entry.exit = _rank_exit(status, entry.said_goodbye, entry.stopped_for)
        logger.info(
            "rank %d of job %s (pid %d): %s%s",
            entry.identity.rank,
            entry.identity.job,
            entry.pid,
            status.description,
            " after a goodbye" if entry.said_goodbye else "",
        )

    def _require(self, instance_id: str) -> RankEntry:
        entry = self._entries.get(instance_id)
        if entry is None:
            raise RankGoneError(f"instance {instance_id} is not registered (already reported as exited)")
        return entry

    @staticmethod
    def _replace_identity(entry: RankEntry, identity: training_pb2.RankIdentity) -> None:
        """Take the new identity; results saved as another rank or job do not go out as this one."""
        before = entry.identity
        if entry.checkpoint_results and (identity.job, identity.rank) != (before.job, before.rank):
            logger.warning(
                "rank %d of job %s (pid %d) became rank %d of job %s with %d checkpoint results not "
                "reported yet; they are dropped (a result counts only for the rank that saved it)",
                before.rank,
                before.job,
                entry.pid,
                identity.rank,
                identity.job,
                len(entry.checkpoint_results),
            )
            entry.checkpoint_results.clear()
        entry.identity = identity

    @staticmethod
    def _check_same_process(entry: RankEntry, identity: training_pb2.RankIdentity, field: str) -> None:
        if identity.instance_id != entry.instance_id:
            raise InvalidHookMessageError(
                f"{field}.instance_id",
                f"must stay {entry.instance_id} on this stream, got {identity.instance_id}",
            )
        if identity.pid != entry.pid:
            raise InvalidHookMessageError(
                f"{field}.pid",
                f"instance {entry.instance_id} registered with pid {entry.pid}, got {identity.pid}",
            )


def _rank_exit(status: ExitStatus, said_goodbye: bool, stopped_for: str) -> training_pb2.RankExit:
    description = (
        f"{status.description} (stopped by clusterwatch: {stopped_for})"
        if stopped_for
        else status.description
    )
    rank_exit = training_pb2.RankExit(
        timestamp_unix_seconds=status.timestamp_unix_s,
        clean=said_goodbye or bool(stopped_for),
        description=description,
    )
    if status.exit_code is not None:
        rank_exit.exit_code = status.exit_code
    if status.signal is not None:
        rank_exit.signal = status.signal
    return rank_exit
