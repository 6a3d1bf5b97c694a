"""Stop the local worker processes of a job so that their launcher restarts them.

The coordinator restarts a job by stopping its workers on every node:
torchrun (``--max-restarts``) sees its worker group fail and starts a new one,
and the hooks resume from the last complete checkpoint. Per worker, the whole
process tree (data-loader and compile workers...) is taken at the start. Every
process of every tree gets SIGTERM at once (workers first), then SIGCONT so a
stopped process (``kill -STOP``, a debugger) can act on it, as systemd does;
after the grace period what is left gets SIGKILL. With ``stop_launcher`` the
workers' parent (the torchrun elastic agent) and its tree at that moment are
stopped the same way afterwards, so the group is not restarted here (a group
it already restarted in between is in that tree and goes with it).

Gone means: no such process, or a zombie. A zombie whose parent is this agent
is reaped here; one of another parent (torchrun reaps its workers on its next
poll) counts as gone and is named in the summary. ``psutil.wait_procs`` is not
used: it counts another parent's zombie as alive and waits out its timeout.

Waiting happens on the event loop in short sleeps (each poll reads
``/proc/PID/stat`` of the processes not yet gone); tree walks, which read
every process on the host, run in a thread. A process changing hands between
the snapshot and a signal is caught by psutil's pid-reuse check (its start
time): a recycled pid is never signalled. Children a worker forks after the
snapshot are not in its tree. Times are measured to within ``poll_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from pathlib import Path

import psutil

from clusterwatch.agent.process_instance import INIT_NAMES, ProcessInstance, still_running
from clusterwatch.v1 import agent_pb2

logger = logging.getLogger(__name__)

DEFAULT_GRACE_S = 10.0
# A typo in a command must not hold a stop open for hours.
MAX_GRACE_S = 300.0
DEFAULT_KILL_WAIT_S = 2.0
DEFAULT_POLL_S = 0.02
DEFAULT_GPU_CHECK_TIMEOUT_S = 10.0
NOT_A_RANK = -1

# Pids of processes holding GPU memory, read after the stop; None: this node has no GPUs.
GpuPidsProbe = Callable[[], Awaitable[Collection[int] | None]]


class StopOutcome(enum.StrEnum):
    """How one process ended; the value is StoppedProcess.outcome.

    Transitions (per process)::

        (start) -- not there, or a zombie            -> ALREADY_GONE
        SIGTERM -- gone within the grace period      -> SIGTERM
        SIGKILL -- gone within the kill wait         -> SIGKILL
        SIGKILL -- still there (stuck in the kernel) -> SURVIVED
    """

    SIGTERM = "sigterm"
    SIGKILL = "sigkill"
    ALREADY_GONE = "already_gone"
    SURVIVED = "survived"


@dataclasses.dataclass(slots=True)
class _Member:
    """One process of a stop: a worker, a process of a worker's tree, or a launcher."""

    pid: int
    rank: int
    process: psutil.Process | None  # None: gone before the stop began
    launcher: bool = False
    outcome: StopOutcome | None = None
    seconds: float = 0.0

    def stopped(self) -> agent_pb2.StoppedProcess:
        # _stop_group gives every member an outcome; unknown would have to count as not gone.
        outcome = self.outcome or StopOutcome.SURVIVED
        return agent_pb2.StoppedProcess(
            pid=self.pid, rank=self.rank, outcome=outcome.value, seconds=self.seconds
        )


@dataclasses.dataclass(slots=True)
class StopReport:
    """What a stop did.

    Attributes:
        job: the job whose workers were stopped.
        workers: how many registered worker processes were named.
        processes: every process dealt with, workers first, then their trees, then launchers.
        launchers: pids of the launcher processes stopped.
        launcher_note: which parents of the workers were not stopped as launchers and why, or
            that none was found ("" otherwise).
        refused: named pids that must never be stopped (this agent, its ancestors, init), with why.
        zombies: pids that are zombies at the end (another parent's, left to it); they count as gone.
        gpu_holders: stopped pids still holding GPU memory afterwards; None: not checked (no GPUs).
        gpu_note: why the GPU memory check could not be made ("" otherwise).
        seconds: from the start of the stop to its end.
    """

    job: str
    workers: int
    processes: list[agent_pb2.StoppedProcess]
    launchers: list[int] = dataclasses.field(default_factory=list)
    launcher_note: str = ""
    refused: dict[int, str] = dataclasses.field(default_factory=dict)
    zombies: list[int] = dataclasses.field(default_factory=list)
    gpu_holders: list[int] | None = None
    gpu_note: str = ""
    seconds: float = 0.0

    @property
    def survivors(self) -> list[int]:
        return [p.pid for p in self.processes if p.outcome == StopOutcome.SURVIVED.value]

    @property
    def ok(self) -> bool:
        """Nothing survived and nothing named had to be refused."""
        return not self.survivors and not self.refused

    def summary(self) -> str:
        """One line for CommandResult.message and the log."""
        counts = dict.fromkeys(StopOutcome, 0)
        for process in self.processes:
            counts[StopOutcome(process.outcome)] += 1
        whom = _plural(self.workers, "worker")
        if self.launchers:
            whom += " and " + _plural(len(self.launchers), "launcher")
        verb = "stopped" if self.ok else "could not stop all of"
        parts = [
            f"{count} {label}"
            for outcome, label in (
                (StopOutcome.SIGTERM, "by SIGTERM"),
                (StopOutcome.SIGKILL, "by SIGKILL"),
                (StopOutcome.ALREADY_GONE, "already gone"),
                (StopOutcome.SURVIVED, "survived SIGKILL"),
            )
            if (count := counts[outcome])
        ]
        line = (
            f"{verb} {whom} ({_plural(len(self.processes), 'process', 'processes')}) of job {self.job}"
            f" in {self.seconds:.1f} s: {', '.join(parts) or 'nothing to do'}"
        )
        notes: list[str] = []
        if self.survivors:
            notes.append("still running: pids " + _pids(self.survivors))
        if self.refused:
            notes.append("refused " + ", ".join(f"pid {pid} ({why})" for pid, why in self.refused.items()))
        if self.zombies:
            notes.append(f"{_plural(len(self.zombies), 'zombie')} left for their parent to reap")
        if self.launcher_note:
            notes.append(self.launcher_note)
        if self.gpu_holders:
            notes.append("GPU memory still held by pids " + _pids(self.gpu_holders))
        elif self.gpu_holders is not None:
            notes.append("GPU memory released")
        if self.gpu_note:
            notes.append(self.gpu_note)
        return "; ".join([line, *notes])


class WorkerStopper:
    """Stops worker process trees: SIGTERM, a grace period, SIGKILL, reap, report.

    Args:
        kill_wait_s: how long to wait for processes to go after SIGKILL.
        poll_s: how often the processes not yet gone are looked at.
        gpu_pids: pids holding GPU memory, read after the stop; None: no GPUs here (no check).
        gpu_check_timeout_s: how long ``gpu_pids`` may take before the check is skipped.
        proc_root: where /proc is (registered workers are checked against it).
    """

    def __init__(
        self,
        kill_wait_s: float = DEFAULT_KILL_WAIT_S,
        poll_s: float = DEFAULT_POLL_S,
        gpu_pids: GpuPidsProbe | None = None,
        gpu_check_timeout_s: float = DEFAULT_GPU_CHECK_TIMEOUT_S,
        proc_root: Path = Path("/proc"),
    ) -> None:
        if kill_wait_s <= 0 or poll_s <= 0 or gpu_check_timeout_s <= 0:
            raise ValueError("kill_wait_s, poll_s and gpu_check_timeout_s must be positive")
        self.kill_wait_s = kill_wait_s
        self.poll_s = poll_s
        self._gpu_pids = gpu_pids
        self.gpu_check_timeout_s = gpu_check_timeout_s
        self._proc_root = proc_root

    async def stop(
        self,
        job: str,
        workers: Mapping[int, int],
        grace_s: float = DEFAULT_GRACE_S,
        stop_launcher: bool = False,
        registered: Mapping[int, ProcessInstance] | None = None,
    ) -> StopReport:
        """Stop ``workers`` ({pid: rank}) with their trees and, with ``stop_launcher``, their launchers.

        Args:
            job: for the report and the log.
            workers: the registered worker processes of ``job`` on this node.
            grace_s: from SIGTERM to SIGKILL; not finite or <= 0: DEFAULT_GRACE_S; capped at MAX_GRACE_S.
            registered: the process each worker pid stood for when it registered; a pid now
                held by another process (the worker exited, the pid was reused) is not signalled.

        Returns:
            One entry per process; never raises for a process that is gone or not ours to signal.
        """
        grace_s = effective_grace_s(grace_s)
        started = time.monotonic()
        protected = _protected_pids()
        report = StopReport(job=job, workers=len(workers), processes=[])
        targets: dict[int, int] = {}
        for pid, rank in workers.items():
            if pid in protected:
                report.refused[pid] = protected[pid]
                logger.error(
                    "job %s registered pid %d as rank %d: %s; not stopping it", job, pid, rank, protected[pid]
                )
            else:
                targets[pid] = rank
        members, parents, replaced = await asyncio.to_thread(
            _worker_trees, targets, set(protected), registered or {}, self._proc_root
        )
        for pid in replaced:
            report.refused[pid] = "no longer the registered worker: the pid belongs to another process now"
            logger.error("job %s: pid %d is no longer the worker that registered; not stopping it", job, pid)
        await self._stop_group(members, grace_s)
        if stop_launcher:
            launchers, report.launcher_note = _launchers(parents, protected)
            handled = {m.process for m in members if m.process is not None}
            launcher_members = await asyncio.to_thread(_launcher_trees, launchers, handled, set(protected))
            await self._stop_group(launcher_members, grace_s)
            report.launchers = [m.pid for m in launcher_members if m.launcher]
            members += launcher_members
        report.processes = [m.stopped() for m in members]
        # The last look: gone ones stay gone (a recycled pid is another process), but a
        # zombie seen earlier may have been reaped since, or a tree member become one.
        report.zombies = [
            m.pid
            for m in members
            if m.process is not None and m.outcome is not StopOutcome.SURVIVED and _is_zombie(m.process)
        ]
        await self._check_gpu_memory(report)
        report.seconds = time.monotonic() - started
        return report

    async def _stop_group(self, members: list[_Member], grace_s: float) -> None:
        """SIGTERM (then SIGCONT) to every member at once, wait, SIGKILL the rest, wait; set each outcome."""
        first_signal = time.monotonic()
        for member in members:  # workers (or launchers) come first in the list
            if _gone(member):
                member.outcome = StopOutcome.ALREADY_GONE
            elif not _signal(member, signal.SIGTERM):
                member.outcome, member.seconds = StopOutcome.SIGTERM, time.monotonic() - first_signal
            else:
                _signal(member, signal.SIGCONT)
        await self._wait_gone(members, StopOutcome.SIGTERM, first_signal, grace_s)
        left = [m for m in members if m.outcome is None]
        if not left:
            return
        logger.warning(
            "%s still running %.1f s after SIGTERM: sending SIGKILL",
            _plural(len(left), "process", "processes"),
            grace_s,
        )
        for member in left:
            if not _signal(member, signal.SIGKILL):
                member.outcome, member.seconds = StopOutcome.SIGTERM, time.monotonic() - first_signal
        await self._wait_gone(members, StopOutcome.SIGKILL, first_signal, self.kill_wait_s)
        for member in members:
            if member.outcome is None:
                member.outcome, member.seconds = StopOutcome.SURVIVED, time.monotonic() - first_signal
                logger.error(
                    "pid %d (rank %d) survived SIGKILL (stuck in the kernel?)", member.pid, member.rank
                )

    async def _wait_gone(
        self, members: list[_Member], outcome: StopOutcome, first_signal: float, wait_s: float
    ) -> None:
        """Until every member without an outcome is gone (it gets ``outcome``) or ``wait_s`` has passed."""
        deadline = time.monotonic() + wait_s
        while True:
            pending = [m for m in members if m.outcome is None]
            for member in pending:
                if _gone(member):
                    member.outcome, member.seconds = outcome, time.monotonic() - first_signal
            if all(m.outcome is not None for m in pending) or time.monotonic() >= deadline:
                return
            await asyncio.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))

    async def _check_gpu_memory(self, report: StopReport) -> None:
        if self._gpu_pids is None:
            return
        try:
            holders = await asyncio.wait_for(self._gpu_pids(), self.gpu_check_timeout_s)
        except TimeoutError:
            report.gpu_note = f"GPU memory not checked: no GPU reading within {self.gpu_check_timeout_s:g} s"
            return
        except Exception as exc:  # failure is data: the stop itself is done
            logger.exception("reading which processes hold GPU memory failed")
            report.gpu_note = f"GPU memory not checked: {exc}"
            return
        if holders is None:  # no GPUs on this node
            return
        held = set(holders)
        report.gpu_holders = sorted({p.pid for p in report.processes} & held)
        if report.gpu_holders:
            logger.warning(
                "after stopping job %s, pids %s still hold GPU memory", report.job, report.gpu_holders
            )


def effective_grace_s(grace_s: float) -> float:
    """A command's grace_seconds as used: not finite or <= 0 means the default; capped at MAX_GRACE_S."""
    if not math.isfinite(grace_s) or grace_s <= 0:
        return DEFAULT_GRACE_S
    return min(grace_s, MAX_GRACE_S)


def _protected_pids() -> dict[int, str]:
    """Processes a stop must never signal, with why: init, this agent and its ancestors."""
    protected = {0: "not a process", 1: "init"}
    agent = psutil.Process()
    protected[agent.pid] = "the agent itself"
    with contextlib.suppress(psutil.Error):
        for ancestor in agent.parents():
            protected.setdefault(ancestor.pid, "an ancestor of the agent")
    return protected


def _worker_trees(
    workers: Mapping[int, int],
    protected: set[int],
    registered: Mapping[int, ProcessInstance],
    proc_root: Path,
) -> tuple[list[_Member], list[psutil.Process], list[int]]:
    """The members of every worker's tree (workers first), the workers' parents, and the worker
    pids that another process holds now (left out), read now."""
    ranks: list[_Member] = []
    descendants: list[_Member] = []
    parents: list[psutil.Process] = []
    replaced: list[int] = []
    seen: set[int] = set(workers)
    for pid, rank in workers.items():
        try:
            process = psutil.Process(pid)
            # After psutil bound itself to the process holding the pid (its own reuse check
            # guards every later signal): is that still the one that registered?
            if pid in registered and not still_running(registered[pid], proc_root):
                replaced.append(pid)
                continue
            children = process.children(recursive=True)
            parent = process.parent()
        except psutil.Error:  # gone (or unreadable: then signals will tell)
            ranks.append(_Member(pid, rank, None))
            continue
        ranks.append(_Member(pid, rank, process))
        if parent is not None and parent not in parents:
            parents.append(parent)
        for child in children:
            if child.pid not in seen and child.pid not in protected:
                seen.add(child.pid)
                descendants.append(_Member(child.pid, NOT_A_RANK, child))
    return ranks + descendants, parents, replaced


def _launchers(
    parents: Iterable[psutil.Process], protected: Mapping[int, str]
) -> tuple[list[psutil.Process], str]:
    """The workers' parents that may be stopped as launchers; if none, why not."""
    launchers: list[psutil.Process] = []
    skipped: list[str] = []
    for parent in parents:
        name = _name(parent)
        if parent.pid in protected:
            skipped.append(f"pid {parent.pid} is {protected[parent.pid]}")
        elif name in INIT_NAMES or name.startswith("containerd-shim"):
            skipped.append(f"pid {parent.pid} ({name}) is an init process")
        else:
            launchers.append(parent)
    if skipped:
        return launchers, "not stopped as a launcher: " + ", ".join(skipped)
    return launchers, "" if launchers else "no launcher found (the workers were gone)"


def _launcher_trees(
    launchers: Iterable[psutil.Process], handled: set[psutil.Process], protected: set[int]
) -> list[_Member]:
    """Each launcher and what it runs now (a worker group it restarted meanwhile), launchers first."""
    heads: list[_Member] = []
    descendants: list[_Member] = []
    seen = set(handled)
    for launcher in launchers:
        heads.append(_Member(launcher.pid, NOT_A_RANK, launcher, launcher=True))
        seen.add(launcher)
        with contextlib.suppress(psutil.Error):
            for child in launcher.children(recursive=True):
                if child not in seen and child.pid not in protected:
                    seen.add(child)
                    descendants.append(_Member(child.pid, NOT_A_RANK, child))
    return heads + descendants


def _gone(member: _Member) -> bool:
    """Whether the process is gone: no longer there (or its pid reused), or a zombie.

    A zombie child of this agent is reaped; another parent's is left to it.
    """
    process = member.process
    if process is None:
        return True
    try:
        if not process.is_running():  # exited, or the pid now belongs to another process
            return True
        if process.status() != psutil.STATUS_ZOMBIE:
            return False
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False
    with contextlib.suppress(ChildProcessError):  # not ours, or reaped by its parent meanwhile
        os.waitpid(member.pid, os.WNOHANG)  # our own child: reap it
    return True


def _is_zombie(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(member: _Member, signum: signal.Signals) -> bool:
    """Send ``signum``; False when the process is already gone (pid reuse included)."""
    if member.process is None:
        return False
    try:
        member.process.send_signal(signum)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        logger.error("not allowed to send %s to pid %d", signum.name, member.pid)
    return True


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return ""


def _plural(count: int, singular: str, plural: str = "") -> str:
    return f"{count} {singular if count == 1 else plural or singular + 's'}"


def _pids(pids: Iterable[int]) -> str:
    return ", ".join(map(str, pids))
