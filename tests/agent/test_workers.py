"""Stopping a job's workers: real process trees, a real launcher, a real agent.

Workers are child Pythons that each start a ``sleep`` of their own (their
tree); some exit on SIGTERM, one ignores it, one is paused with SIGSTOP. The
launcher is a small parent that, like torchrun with --max-restarts, starts a
worker group, waits for it, and starts the next; on SIGTERM it terminates its
group and exits. The one fake is the GPU memory probe (NVML is hardware).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Collection, Iterator
from pathlib import Path

import psutil
import pytest
from fakes.fake_pynvml import FakeNvml, h100
from helpers import wait_for
from test_agent_hooks import agent_settings, eventually, running_agent

from clusterwatch.agent.collectors.gpu import GpuCollector
from clusterwatch.agent.commands import CommandHandler
from clusterwatch.agent.gpu.nvml_backend import NvmlBackend
from clusterwatch.agent.proc_exit import ProcessExitWatcher
from clusterwatch.agent.ranks import RankRegistry
from clusterwatch.agent.runtime import Agent
from clusterwatch.agent.workers import StopReport, WorkerStopper, effective_grace_s
from clusterwatch.v1 import agent_pb2, training_pb2

OK = agent_pb2.CommandResult.Status.STATUS_OK
FAILED = agent_pb2.CommandResult.Status.STATUS_FAILED
UNSUPPORTED = agent_pb2.CommandResult.Status.STATUS_UNSUPPORTED
GIB = 1024**3

# A worker with a tree: its own child (a data-loader worker, say), then it idles.
# "stubborn" ignores SIGTERM (after starting the child, which keeps the default).
WORKER = r"""
import os, pathlib, signal, subprocess, sys, time
ready, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
child = subprocess.Popen(["sleep", "600"])
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
ready.with_suffix(".tmp").write_text(str(child.pid))
ready.with_suffix(".tmp").rename(ready)
if len(sys.argv) > 3:  # registers itself on an agent's hook socket, as rank argv[4] of job "j"
    import queue, grpc
    from clusterwatch.hook.transport import fetch_credential_nonce
    from clusterwatch.v1 import hook_pb2, hook_pb2_grpc, training_pb2
    path, rank = sys.argv[3], int(sys.argv[4])
    outgoing = queue.Queue()
    outgoing.put(hook_pb2.HookMessage(hello=training_pb2.RankIdentity(
        job="j", rank=rank, world_size=2, pid=os.getpid(), instance_id=f"worker-{rank}"),
        credential_nonce=fetch_credential_nonce(path, 10)))
    channel = grpc.insecure_channel("unix:" + path)
    call = hook_pb2_grpc.HookServiceStub(channel).Connect(iter(outgoing.get, None))
while True:
    time.sleep(1)
"""

# Like torchrun --max-restarts: run a group of two workers, wait for all, start the next
# group. On SIGTERM: terminate the group, wait for it, exit. Logs "generation pid" per worker.
LAUNCHER = r"""
import pathlib, signal, subprocess, sys
log = pathlib.Path(sys.argv[1])
group, stopping = [], False
def stop(signum, frame):
    global stopping
    stopping = True
    for worker in group:
        worker.terminate()
signal.signal(signal.SIGTERM, stop)
generation = 0
while not stopping:
    group = [subprocess.Popen(["sleep", "600"]) for _ in range(2)]
    if stopping:
        for worker in group:
            worker.terminate()
    with log.open("a") as out:
        out.write("".join(f"{generation} {worker.pid}\n" for worker in group))
    for worker in group:
        worker.wait()
    generation += 1
"""

# A training process as the agent sees it: registered on the hook socket, with a child of its own.
HOOKED_WORKER = r"""
import os, queue, subprocess, sys, time
import grpc
from clusterwatch.hook.transport import fetch_credential_nonce
from clusterwatch.v1 import hook_pb2, hook_pb2_grpc, training_pb2
path, job, rank = sys.argv[1:4]
child = subprocess.Popen(["sleep", "600"])
outgoing = queue.Queue()
outgoing.put(hook_pb2.HookMessage(hello=training_pb2.RankIdentity(
    job=job, rank=int(rank), world_size=2, pid=os.getpid(), instance_id=f"worker-{rank}"),
    credential_nonce=fetch_credential_nonce(path, 10)))
channel = grpc.insecure_channel("unix:" + path)
call = hook_pb2_grpc.HookServiceStub(channel).Connect(iter(outgoing.get, None))
while True:
    time.sleep(1)
"""


class Worker:
    """A started WORKER and the pid of its child."""

    def __init__(self, popen: subprocess.Popen[bytes], child_pid: int) -> None:
        self.popen = popen
        self.child_pid = child_pid

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def tree(self) -> list[int]:
        return [self.pid, self.child_pid]


class Processes:
    """Starts the test's processes; whatever is still alive at the end is killed."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[psutil.Process] = []
        self.popens: list[subprocess.Popen[bytes]] = []

    def popen(self, argv: list[str]) -> subprocess.Popen[bytes]:
        popen = subprocess.Popen(argv)
        self.popens.append(popen)
        self.started.append(psutil.Process(popen.pid))
        return popen

    def worker(self, mode: str = "obedient", *, socket: Path | None = None, rank: int = 0) -> Worker:
        """A WORKER; with ``socket``, registered there (by itself) as ``rank`` of job "j"."""
        ready = self.tmp_path / f"worker-{len(self.popens)}.ready"
        hook = [str(socket), str(rank)] if socket is not None else []
        popen = self.popen([sys.executable, "-c", WORKER, str(ready), mode, *hook])
        child_pid = int(
            wait_for(lambda: ready.read_text() if ready.exists() else None, 20, "the worker to start")
        )
        self.started.append(psutil.Process(child_pid))
        return Worker(popen, child_pid)

    def adopt(self, pid: int) -> None:
        """Kill ``pid`` at the end too, if it is still the same process then."""
        with contextlib.suppress(psutil.NoSuchProcess):
            self.started.append(psutil.Process(pid))

    def close(self) -> None:
        for process in self.started:
            try:
                process.send_signal(signal.SIGCONT)
                process.kill()
            except psutil.NoSuchProcess:
                pass
        for popen in self.popens:
            popen.wait(timeout=10)  # already reaped by the stopper: returns at once


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    started = Processes(tmp_path)
    yield started
    started.close()


def alive(pid: int) -> bool:
    """Running, sleeping, stopped...: anything but gone or a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def outcomes(report: StopReport | agent_pb2.CommandResult) -> dict[int, tuple[int, str]]:
    """{pid: (rank, outcome)}."""
    stopped = report.processes if isinstance(report, StopReport) else report.stopped
    return {p.pid: (p.rank, p.outcome) for p in stopped}


@pytest.mark.timeout(30)
async def test_workers_and_their_trees_end_on_sigterm(processes: Processes) -> None:
    first, second = processes.worker(), processes.worker()
    report = await WorkerStopper().stop("j", {first.pid: 0, second.pid: 1})
    assert outcomes(report) == {
        first.pid: (0, "sigterm"),
        second.pid: (1, "sigterm"),
        first.child_pid: (-1, "sigterm"),
        second.child_pid: (-1, "sigterm"),
    }
    assert [p.pid for p in report.processes[:2]] == [first.pid, second.pid]  # workers first
    assert all(p.seconds >= 0 for p in report.processes)
    assert report.ok
    assert report.summary().startswith("stopped 2 workers (4 processes) of job j in ")
    assert " s: 4 by SIGTERM" in report.summary()
    for pid in first.tree + second.tree:
        assert not alive(pid)
    # The workers were this process's children: reaped, not left as zombies.
    assert not psutil.pid_exists(first.pid)
    assert not psutil.pid_exists(second.pid)


@pytest.mark.timeout(30)
async def test_a_worker_ignoring_sigterm_is_killed_after_the_grace_period(processes: Processes) -> None:
    stubborn, obedient = processes.worker("stubborn"), processes.worker()
    report = await WorkerStopper().stop("j", {stubborn.pid: 0, obedient.pid: 1}, grace_s=0.3)
    assert outcomes(report) == {
        stubborn.pid: (0, "sigkill"),
        obedient.pid: (1, "sigterm"),
        stubborn.child_pid: (-1, "sigterm"),  # its child kept the default SIGTERM action
        obedient.child_pid: (-1, "sigterm"),
    }
    killed = next(p for p in report.processes if p.pid == stubborn.pid)
    assert killed.seconds >= 0.3  # it had the whole grace period
    assert report.ok
    assert " s: 3 by SIGTERM, 1 by SIGKILL" in report.summary()
    for pid in stubborn.tree + obedient.tree:
        assert not alive(pid)


@pytest.mark.timeout(30)
async def test_a_paused_worker_is_woken_to_act_on_sigterm(processes: Processes) -> None:
    paused = processes.worker()
    os.kill(paused.pid, signal.SIGSTOP)
    wait_for(lambda: psutil.Process(paused.pid).status() == psutil.STATUS_STOPPED, 10, "the worker to pause")
    report = await WorkerStopper().stop("j", {paused.pid: 3}, grace_s=20)
    assert outcomes(report)[paused.pid] == (3, "sigterm")  # SIGCONT after SIGTERM: no wait for SIGKILL
    assert not alive(paused.pid)


@pytest.mark.timeout(30)
async def test_gone_workers_and_zombies_are_already_gone(processes: Processes) -> None:
    running = processes.worker()
    exited = processes.popen([sys.executable, "-c", "pass"])
    exited.wait(timeout=10)
    zombie = processes.popen([sys.executable, "-c", "pass"])
    wait_for(lambda: psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE, 20, "a zombie child")
    report = await WorkerStopper().stop("j", {exited.pid: 0, zombie.pid: 1, running.pid: 2})
    assert outcomes(report) == {
        exited.pid: (0, "already_gone"),
        zombie.pid: (1, "already_gone"),
        running.pid: (2, "sigterm"),
        running.child_pid: (-1, "sigterm"),
    }
    assert not psutil.pid_exists(zombie.pid)  # our own zombie child: reaped
    assert " s: 2 by SIGTERM, 2 already gone" in report.summary()


def launcher_log(log: Path) -> list[tuple[int, int]]:
    """(generation, pid) of every worker the launcher started, so far."""
    if not log.exists():
        return []
    return [(int(g), int(p)) for g, p in (line.split() for line in log.read_text().splitlines())]


def start_launcher(processes: Processes, log: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    """The launcher and the pids of its first worker group, once it runs."""
    launcher = processes.popen([sys.executable, "-c", LAUNCHER, str(log)])
    wait_for(lambda: len(launcher_log(log)) >= 2, 20, "the launcher's first group")
    group = [pid for generation, pid in launcher_log(log) if generation == 0]
    for pid in group:
        processes.adopt(pid)
    return launcher, group


@pytest.mark.timeout(30)
async def test_without_stop_launcher_the_launcher_restarts_the_group(
    processes: Processes, tmp_path: Path
) -> None:
    log = tmp_path / "launcher.log"
    launcher, group = start_launcher(processes, log)
    report = await WorkerStopper().stop("j", {group[0]: 0, group[1]: 1})
    assert outcomes(report) == {group[0]: (0, "sigterm"), group[1]: (1, "sigterm")}
    assert report.launchers == []
    restarted = wait_for(
        lambda: [pid for generation, pid in launcher_log(log) if generation == 1], 20, "the next group"
    )
    for pid in restarted:
        processes.adopt(pid)
    assert launcher.poll() is None
    assert not any(alive(pid) for pid in group)


@pytest.mark.timeout(30)
async def test_stop_launcher_stops_the_workers_parent_after_them(
    processes: Processes, tmp_path: Path
) -> None:
    log = tmp_path / "launcher.log"
    launcher, group = start_launcher(processes, log)
    report = await WorkerStopper().stop("j", {group[0]: 0, group[1]: 1}, stop_launcher=True)
    assert report.launchers == [launcher.pid]
    stopped = outcomes(report)
    assert stopped[group[0]] == (0, "sigterm")
    assert stopped[group[1]] == (1, "sigterm")
    assert stopped[launcher.pid] == (-1, "sigterm")
    assert report.processes[2].pid == launcher.pid  # after the workers, before what it restarted
    # A group it restarted before its SIGTERM is in its tree: stopped too, not a rank.
    assert all(rank == -1 for pid, (rank, _) in stopped.items() if pid not in group)
    assert report.ok
    assert report.launcher_note == ""
    assert "1 launcher" in report.summary()
    for _, pid in launcher_log(log):
        assert not alive(pid)
    assert not psutil.pid_exists(launcher.pid)  # our child: reaped


def registry() -> RankRegistry:
    return RankRegistry(max_steps_per_report=8, exit_watcher=ProcessExitWatcher())  # polling, unstarted


def identity(rank: int, pid: int, job: str = "j") -> training_pb2.RankIdentity:
    return training_pb2.RankIdentity(
        job=job, rank=rank, world_size=8, pid=pid, instance_id=f"{job}-{rank}-{pid}"
    )


def stop_command(command_id: str, **fields: object) -> agent_pb2.Command:
    return agent_pb2.Command(command_id=command_id, stop_workers=agent_pb2.StopWorkersCommand(**fields))  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_registry_lists_every_process_of_a_job_that_may_still_run() -> None:
    ranks = registry()
    stream = ranks.hello(identity(0, 101))
    ranks.disconnect("j-0-101", stream)  # its hook is gone, maybe not the process
    ranks.hello(identity(0, 102))  # the same rank again, in another process
    ranks.hello(identity(1, 103))
    ranks.hello(identity(0, 104, job="k"))
    assert ranks.worker_pids("j") == {101: 0, 102: 0, 103: 1}
    assert ranks.worker_pids("k") == {104: 0}
    assert ranks.worker_pids("other") == {}


@pytest.mark.timeout(30)
async def test_command_handler_stops_the_jobs_registered_workers(processes: Processes) -> None:
    ranks = registry()
    first, second, other_job = processes.worker(), processes.worker(), processes.worker()
    ranks.hello(identity(0, first.pid))
    ranks.hello(identity(1, second.pid))
    ranks.hello(identity(0, other_job.pid, job="k"))
    handler = CommandHandler(worker_lookup=ranks)
    command = stop_command("s-1", job="j", grace_seconds=0, reason="hang incident h-1")
    result = await handler.handle(command)
    assert (result.command_id, result.status) == ("s-1", OK)
    assert result.message.startswith("stopped 2 workers (4 processes) of job j in ")
    assert " s: 4 by SIGTERM" in result.message
    assert outcomes(result) == {
        first.pid: (0, "sigterm"),
        second.pid: (1, "sigterm"),
        first.child_pid: (-1, "sigterm"),
        second.child_pid: (-1, "sigterm"),
    }
    assert alive(other_job.pid)  # another job's worker is left alone
    assert handler.cordoned_jobs == set()
    assert await handler.handle(command) is result  # a replayed id is not run again


@pytest.mark.timeout(30)
async def test_command_handler_fails_a_stop_it_cannot_carry_out(processes: Processes) -> None:
    ranks = registry()
    ranks.hello(identity(0, processes.worker().pid))
    handler = CommandHandler(worker_lookup=ranks)
    no_job = await handler.handle(stop_command("s-1"))
    assert (no_job.status, no_job.message) == (FAILED, "stop_workers command names no job")
    elsewhere = await handler.handle(stop_command("s-2", job="k"))
    assert (elsewhere.status, elsewhere.message) == (FAILED, "no worker of job k on this node")
    without_hook = await CommandHandler().handle(stop_command("s-3", job="j"))
    assert without_hook.status == UNSUPPORTED


@pytest.mark.timeout(30)
async def test_the_agent_itself_is_never_stopped(processes: Processes) -> None:
    """A hook can claim any pid; the agent's own (here: this test's) is refused."""
    ranks = registry()
    worker = processes.worker()
    ranks.hello(identity(0, os.getpid()))
    ranks.hello(identity(1, worker.pid))
    result = await CommandHandler(worker_lookup=ranks).handle(stop_command("s-1", job="j"))
    assert result.status == FAILED
    assert f"refused pid {os.getpid()} (the agent itself)" in result.message
    assert outcomes(result) == {worker.pid: (1, "sigterm"), worker.child_pid: (-1, "sigterm")}


@pytest.mark.timeout(30)
async def test_gpu_memory_still_held_is_named(processes: Processes) -> None:
    holders: Collection[int] | None = None

    async def gpu_pids() -> Collection[int] | None:
        return holders

    stopper = WorkerStopper(gpu_pids=gpu_pids)
    worker = processes.worker()
    holders = {worker.child_pid, 1}  # as NVML would list them after the stop
    held = await stopper.stop("j", {worker.pid: 0})
    assert held.gpu_holders == [worker.child_pid]  # only stopped processes are named
    assert held.summary().endswith(f"; GPU memory still held by pids {worker.child_pid}")
    holders = set()
    released = await stopper.stop("j", {processes.worker().pid: 0})
    assert released.summary().endswith("; GPU memory released")
    holders = None  # no GPUs on this node
    no_gpus = await stopper.stop("j", {processes.worker().pid: 0})
    assert no_gpus.gpu_holders is None
    assert "GPU" not in no_gpus.summary()


@pytest.mark.timeout(30)
def test_grace_period_defaults_and_cap() -> None:
    assert effective_grace_s(0) == 10.0
    assert effective_grace_s(-1) == 10.0
    assert effective_grace_s(float("nan")) == 10.0
    assert effective_grace_s(2.5) == 2.5
    assert effective_grace_s(1e9) == 300.0


@pytest.mark.timeout(60)
async def test_agent_stops_workers_registered_on_its_hook_socket(tmp_path: Path) -> None:
    """The command down the uplink, the workers from real hook streams, the result back up."""
    async with running_agent(tmp_path) as harness:
        assert "command.stop_workers" in harness.coordinator.hellos[0].capabilities
        # Popen, not asyncio's subprocesses: the stopper reaps its own children, which would
        # race asyncio's child watcher (it then reports an unknown child).
        workers = [
            subprocess.Popen(  # noqa: ASYNC220
                [sys.executable, "-c", HOOKED_WORKER, str(harness.socket_path), "j", str(rank)]
            )
            for rank in (0, 1)
        ]
        try:

            def registered() -> bool:
                return harness.agent.ranks.worker_pids("j") == {w.pid: rank for rank, w in enumerate(workers)}

            await eventually(registered, 30, "both workers to register")
            children = [child.pid for w in workers for child in psutil.Process(w.pid).children()]
            assert len(children) == 2
            command = stop_command("stop-1", job="j", grace_seconds=5, stop_launcher=True, reason="test")
            harness.coordinator.outbox.put_nowait(agent_pb2.CoordinatorMessage(command=command))
            result = await eventually(lambda: harness.coordinator.result("stop-1"), 30, "the stop result")
            assert result.status == OK, result.message
            assert outcomes(result) == {
                workers[0].pid: (0, "sigterm"),
                workers[1].pid: (1, "sigterm"),
                **dict.fromkeys(children, (-1, "sigterm")),
            }
            assert result.message.startswith("stopped 2 workers (4 processes) of job j in ")
            # Their parent is the agent (this test): never stopped as a launcher.
            assert f"not stopped as a launcher: pid {os.getpid()} is the agent itself" in result.message
            assert result.message.endswith("; node cordoned for job j")
            assert "GPU" not in result.message  # no GPU collector: no check
            assert harness.agent.commands.cordoned_jobs == {"j"}
            for pid in [w.pid for w in workers] + children:
                assert not alive(pid)

            def exits() -> list[training_pb2.RankExit] | None:
                found = [
                    r.exit
                    for report in harness.coordinator.reports
                    for r in report.ranks
                    if r.HasField("exit")
                ]
                return found if len(found) == 2 else None

            # Stopped on purpose: not rank failures.
            for rank_exit in await eventually(exits, 30, "both exits in a node report"):
                assert rank_exit.clean
                assert rank_exit.description.endswith("(stopped by clusterwatch: test)")
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                await asyncio.to_thread(worker.wait, 10)


class LiveProcesses(list[tuple[int, int | None]]):
    """FakeDevice.processes that, like NVML, lists a process only while it is alive."""

    def __iter__(self) -> Iterator[tuple[int, int | None]]:
        return iter([entry for entry in list.__iter__(self) if alive(entry[0])])


@pytest.mark.timeout(60)
async def test_agent_checks_gpu_memory_in_a_report_collected_after_the_stop(
    processes: Processes, tmp_path: Path
) -> None:
    """The agent's own GPU collector (on a fake NVML) answers; a report from before the stop would not do."""
    device = h100(0)
    backend = NvmlBackend(FakeNvml([device]), xid_wait_timeout_ms=50)
    socket_path = tmp_path / "a.sock"
    # No coordinator: the uplink retries meanwhile; commands are handed to the handler directly.
    agent = Agent(agent_settings(1, socket_path), collectors=[GpuCollector(backend)])
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await eventually(lambda: task.done() or (agent.latest and agent.latest.gpus), 20, "a GPU report")
        first = await asyncio.to_thread(processes.worker, socket=socket_path, rank=0)
        device.processes = LiveProcesses([(first.pid, GIB), (first.child_pid, GIB), (os.getpid(), GIB)])
        await eventually(lambda: agent.ranks.worker_pids("j") == {first.pid: 0}, 20, "the worker to register")
        await eventually(
            lambda: {p.pid for p in agent.latest.gpus[0].processes} >= {first.pid, first.child_pid},  # type: ignore[union-attr]
            20,
            "the worker's GPU memory in a report",
        )
        released = await agent.commands.handle(stop_command("s-1", job="j"))
        assert released.status == OK, released.message
        assert released.message.endswith("; GPU memory released")  # this test's own pid is not named
        # A driver that has not let go of a stopped process's memory yet:
        second = await asyncio.to_thread(processes.worker, socket=socket_path, rank=1)
        device.processes = [(second.child_pid, GIB)]
        await eventually(lambda: agent.ranks.worker_pids("j") == {second.pid: 1}, 20, "the next worker")
        held = await agent.commands.handle(stop_command("s-2", job="j"))
        assert held.status == OK, held.message
        assert held.message.endswith(f"; GPU memory still held by pids {second.child_pid}")
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
