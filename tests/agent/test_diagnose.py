"""Diagnosing training processes: their state and a py-spy dump, from real processes.

The processes examined are real child Pythons spinning in a named function
(stopped with SIGSTOP, left as zombies, or gone as the tests need), and the
dumps come from the real py-spy. Where a test needs py-spy to hang or to
wait for its siblings, a small shell script stands in for it: that is the
one boundary the real tool cannot be made to cross on demand.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from helpers import wait_for
from test_agent_hooks import eventually, running_agent

from clusterwatch.agent.commands import CommandHandler
from clusterwatch.agent.diagnose import DiagnosisTarget, ProcessDiagnoser, find_py_spy
from clusterwatch.agent.proc_exit import ProcessExitWatcher
from clusterwatch.agent.ranks import RankRegistry
from clusterwatch.v1 import agent_pb2, node_pb2, training_pb2

OK = agent_pb2.CommandResult.Status.STATUS_OK
FAILED = agent_pb2.CommandResult.Status.STATUS_FAILED
UNSUPPORTED = agent_pb2.CommandResult.Status.STATUS_UNSUPPORTED
AWAKE = {psutil.STATUS_RUNNING, psutil.STATUS_SLEEPING}

SPINNER = r"""
import pathlib, sys, time
def spin_in_named_function(ready):
    ready.touch()
    while True:
        time.sleep(0.005)
spin_in_named_function(pathlib.Path(sys.argv[1]))
"""

# A training process as the agent sees it: registered on the hook socket, then busy.
HOOKED_SPINNER = r"""
import os, pathlib, queue, sys, time
import grpc
from clusterwatch.hook.transport import fetch_credential_nonce
from clusterwatch.v1 import hook_pb2, hook_pb2_grpc, training_pb2
path, job, rank = sys.argv[1:4]
outgoing = queue.Queue()
outgoing.put(hook_pb2.HookMessage(hello=training_pb2.RankIdentity(
    job=job, rank=int(rank), world_size=4, pid=os.getpid(), instance_id=f"spinner-{rank}"),
    credential_nonce=fetch_credential_nonce(path, 10)))
channel = grpc.insecure_channel("unix:" + path)
call = hook_pb2_grpc.HookServiceStub(channel).Connect(iter(outgoing.get, None))
def spin_in_named_function():
    while True:
        time.sleep(0.005)
spin_in_named_function()
"""

Spawn = Callable[[], subprocess.Popen[bytes]]


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Starts spinners (returned once inside their named function); all are killed afterwards."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        ready = tmp_path / f"ready-{len(started)}"
        process = subprocess.Popen([sys.executable, "-c", SPINNER, str(ready)])
        started.append(process)
        wait_for(ready.exists, 20, "the spinner to start")
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.kill()
        process.wait(timeout=10)


def process_state(pid: int) -> str:
    return psutil.Process(pid).status()


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


async def examine(
    diagnoser: ProcessDiagnoser, pid: int, stack_dump: bool = True
) -> training_pb2.ProcessDiagnosis:
    [diagnosis] = await diagnoser.diagnose("j", [DiagnosisTarget(rank=3, pid=pid)], stack_dump=stack_dump)
    assert (diagnosis.job, diagnosis.rank, diagnosis.pid, diagnosis.node_id) == ("j", 3, pid, "")
    return diagnosis


@pytest.mark.timeout(30)
async def test_running_process_state_and_stack_dump_name_its_function(spawn: Spawn) -> None:
    process = spawn()
    diagnosis = await examine(ProcessDiagnoser(), process.pid)
    assert diagnosis.process_state in AWAKE
    assert "spin_in_named_function" in diagnosis.stack_dump
    assert f"Process {process.pid}" in diagnosis.stack_dump
    assert diagnosis.error == ""
    assert not diagnosis.healthy
    assert process.poll() is None  # py-spy let it go on


@pytest.mark.timeout(30)
async def test_without_stack_dump_only_the_state_is_read(spawn: Spawn, tmp_path: Path) -> None:
    process = spawn()
    diagnosis = await examine(ProcessDiagnoser(py_spy=tmp_path / "absent"), process.pid, stack_dump=False)
    assert diagnosis.process_state in AWAKE
    assert (diagnosis.stack_dump, diagnosis.error) == ("", "")


@pytest.mark.timeout(30)
async def test_stopped_process_is_dumped_without_waking_it(spawn: Spawn) -> None:
    process = spawn()
    process.send_signal(signal.SIGSTOP)
    wait_for(lambda: process_state(process.pid) == psutil.STATUS_STOPPED, 10, "the process to stop")
    diagnosis = await examine(ProcessDiagnoser(), process.pid)
    assert diagnosis.process_state == "stopped"
    assert "spin_in_named_function" in diagnosis.stack_dump  # --nonblocking reads the paused process
    assert diagnosis.error == ""
    assert process_state(process.pid) == psutil.STATUS_STOPPED  # and leaves it stopped
    process.send_signal(signal.SIGCONT)
    wait_for(lambda: process_state(process.pid) in AWAKE, 10, "the process to run again")


@pytest.fixture
def zombie() -> Iterator[int]:
    """The pid of a child that exited and is not reaped until the test ends."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        wait_for(lambda: process_state(process.pid) == psutil.STATUS_ZOMBIE, 20, "the child to be a zombie")
        yield process.pid
    finally:
        process.wait(timeout=10)


@pytest.mark.timeout(30)
async def test_zombie_is_reported_as_such(zombie: int) -> None:
    diagnosis = await examine(ProcessDiagnoser(), zombie)
    assert diagnosis.process_state == "zombie"
    assert diagnosis.stack_dump == ""
    assert "zombie" in diagnosis.error


def pid_without_process() -> int:
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # above the largest pid possible


@pytest.mark.timeout(30)
async def test_a_pid_with_no_process_is_an_error_not_a_crash() -> None:
    pid = pid_without_process()
    diagnosis = await examine(ProcessDiagnoser(), pid)
    assert diagnosis.process_state == ""
    assert diagnosis.stack_dump == ""
    assert diagnosis.error == f"process {pid} no longer exists"


@pytest.mark.timeout(30)
async def test_a_process_that_is_not_python_gets_py_spys_reason() -> None:
    process = await asyncio.create_subprocess_exec("sleep", "60")
    try:
        await eventually(lambda: process_state(process.pid) == psutil.STATUS_SLEEPING, 10, "sleep to sleep")
        diagnosis = await examine(ProcessDiagnoser(), process.pid)
        assert diagnosis.process_state == "sleeping"
        assert diagnosis.stack_dump == ""
        # One line, without the Rust backtrace the environment may ask for.
        assert diagnosis.error.startswith("py-spy failed: ")
        assert "python version" in diagnosis.error.lower()
        assert "\n" not in diagnosis.error
    finally:
        process.kill()
        await asyncio.wait_for(process.wait(), 10)


@pytest.mark.timeout(30)
async def test_missing_py_spy_is_named(spawn: Spawn, tmp_path: Path) -> None:
    process = spawn()
    diagnosis = await examine(ProcessDiagnoser(py_spy=tmp_path / "bin" / "py-spy"), process.pid)
    assert diagnosis.process_state in AWAKE
    assert diagnosis.stack_dump == ""
    assert "py-spy is not installed" in diagnosis.error


@pytest.mark.timeout(30)
def test_py_spy_is_found_next_to_the_interpreter_first() -> None:
    beside = Path(sys.executable).parent / "py-spy"
    if not beside.exists():
        pytest.skip("py-spy is not installed next to this interpreter")
    assert find_py_spy() == beside


@pytest.mark.timeout(30)
async def test_a_hanging_py_spy_is_killed_at_the_timeout(spawn: Spawn, tmp_path: Path) -> None:
    process = spawn()
    pid_file = tmp_path / "py-spy.pid"
    hanging = script(tmp_path / "py-spy", f'echo $$ > "{pid_file}"\nexec sleep 60\n')
    diagnosis = await examine(ProcessDiagnoser(py_spy=hanging, dump_timeout_s=0.5), process.pid)
    assert diagnosis.process_state in AWAKE
    assert diagnosis.error == "py-spy timed out after 0.5 s"
    assert not psutil.pid_exists(int(pid_file.read_text()))  # killed and reaped


@pytest.mark.timeout(30)
async def test_dumps_run_at_the_same_time(spawn: Spawn, tmp_path: Path) -> None:
    """Each stand-in dump waits until all three have started: one at a time, the first would give up."""
    processes = [spawn(), spawn(), spawn()]
    arrived = tmp_path / "arrived"
    arrived.mkdir()
    rendezvous = script(
        tmp_path / "py-spy",
        f'touch "{arrived}/$3"\n'  # argv: dump --pid PID
        "i=0\n"
        f'while [ "$(ls "{arrived}" | wc -l)" -lt 3 ]; do\n'
        "  i=$((i + 1)); [ $i -gt 500 ] && { echo 'Error: alone' >&2; exit 1; }\n"
        "  sleep 0.02\n"
        "done\n"
        'echo "stack of $3"\n',
    )
    targets = [DiagnosisTarget(rank, p.pid, healthy=rank == 2) for rank, p in enumerate(processes)]
    diagnoses = await ProcessDiagnoser(py_spy=rendezvous, dump_timeout_s=20).diagnose(
        "j", targets, stack_dump=True
    )
    assert [(d.rank, d.pid, d.healthy, d.error) for d in diagnoses] == [
        (t.rank, t.pid, t.healthy, "") for t in targets
    ]
    assert [d.stack_dump for d in diagnoses] == [f"stack of {t.pid}\n" for t in targets]


def registry() -> RankRegistry:
    return RankRegistry(max_steps_per_report=8, exit_watcher=ProcessExitWatcher())  # polling, unstarted


def identity(rank: int, pid: int, job: str = "j", instance: str = "") -> training_pb2.RankIdentity:
    return training_pb2.RankIdentity(
        job=job, rank=rank, world_size=8, pid=pid, instance_id=instance or f"{job}-{rank}-{pid}"
    )


def diagnose_command(command_id: str, **fields: object) -> agent_pb2.Command:
    return agent_pb2.Command(command_id=command_id, diagnose=agent_pb2.DiagnoseCommand(**fields))  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_registry_finds_the_pid_of_a_rank_that_may_still_run(spawn: Spawn) -> None:
    ranks = registry()
    old, new = spawn(), spawn()
    stream = ranks.hello(identity(0, old.pid))
    ranks.disconnect(f"j-0-{old.pid}", stream)
    assert ranks.pid_of("j", 0) == old.pid  # disconnected: its hook is gone, the process is not
    ranks.hello(identity(0, new.pid))
    assert ranks.pid_of("j", 0) == new.pid  # a running registration wins
    assert ranks.pid_of("j", 1) is None
    assert ranks.pid_of("other", 0) is None
    new.kill()
    new.wait(timeout=10)
    ranks.report_into(node_pb2.NodeReport().ranks)  # the exit is seen (and waits for its stream)
    assert ranks.pid_of("j", 0) == old.pid  # never the pid of an exited process: it may be reused


@pytest.mark.timeout(30)
async def test_command_handler_examines_the_hosted_ranks_only(spawn: Spawn) -> None:
    ranks = registry()
    suspect, healthy, other_job = spawn(), spawn(), spawn()
    ranks.hello(identity(0, suspect.pid))
    ranks.hello(identity(1, healthy.pid))
    ranks.hello(identity(2, other_job.pid, job="k"))
    handler = CommandHandler(process_lookup=ranks)
    command = diagnose_command("d-1", job="j", ranks=[0, 2, 0], healthy_ranks=[1, 0, 5], stack_dump=True)
    result = await handler.handle(command)
    assert (result.command_id, result.status, result.message) == ("d-1", OK, "2 processes examined")
    by_rank = {d.rank: d for d in result.diagnoses}
    assert sorted(by_rank) == [0, 1]  # 2 is another job's, 5 runs elsewhere: left out
    assert (by_rank[0].pid, by_rank[0].healthy) == (suspect.pid, False)  # named as suspect first
    assert (by_rank[1].pid, by_rank[1].healthy) == (healthy.pid, True)
    for diagnosis in result.diagnoses:
        assert diagnosis.job == "j"
        assert diagnosis.node_id == ""
        assert diagnosis.process_state in AWAKE
        assert "spin_in_named_function" in diagnosis.stack_dump
    assert await handler.handle(command) is result  # a replayed id is not run again


@pytest.mark.timeout(30)
async def test_command_handler_fails_a_diagnose_it_cannot_answer(spawn: Spawn) -> None:
    ranks = registry()
    ranks.hello(identity(0, spawn().pid))
    handler = CommandHandler(process_lookup=ranks)
    no_job = await handler.handle(diagnose_command("d-1", ranks=[0]))
    assert (no_job.status, no_job.message) == (FAILED, "diagnose command names no job")
    elsewhere = await handler.handle(diagnose_command("d-2", job="j", ranks=[3], healthy_ranks=[4]))
    assert elsewhere.status == FAILED
    assert "none of the ranks" in elsewhere.message
    assert list(elsewhere.diagnoses) == []
    without_hook = await CommandHandler().handle(diagnose_command("d-3", job="j", ranks=[0]))
    assert without_hook.status == UNSUPPORTED


@pytest.mark.timeout(60)
async def test_agent_diagnoses_ranks_registered_on_its_hook_socket(tmp_path: Path) -> None:
    """The coordinator's command down the uplink, the ranks from real hook streams, the answer back up."""
    async with running_agent(tmp_path) as harness:
        assert "command.diagnose" in harness.coordinator.hellos[0].capabilities
        children = [
            await asyncio.create_subprocess_exec(
                sys.executable, "-c", HOOKED_SPINNER, str(harness.socket_path), "j", str(rank)
            )
            for rank in (0, 1)
        ]
        try:

            def registered() -> bool:
                return all(harness.agent.ranks.pid_of("j", rank) == c.pid for rank, c in enumerate(children))

            await eventually(registered, 30, "both ranks to register")
            children[0].send_signal(signal.SIGSTOP)
            await eventually(
                lambda: process_state(children[0].pid) == psutil.STATUS_STOPPED, 10, "rank 0 to stop"
            )
            command = diagnose_command("diag-1", job="j", ranks=[0], healthy_ranks=[1, 3], stack_dump=True)
            harness.coordinator.outbox.put_nowait(agent_pb2.CoordinatorMessage(command=command))
            result = await eventually(lambda: harness.coordinator.result("diag-1"), 30, "the diagnose result")
            assert (result.status, result.message) == (OK, "2 processes examined")
            stopped, healthy = sorted(result.diagnoses, key=lambda d: d.rank)
            assert (stopped.rank, stopped.pid, stopped.healthy) == (0, children[0].pid, False)
            assert stopped.process_state == "stopped"
            assert "spin_in_named_function" in stopped.stack_dump
            assert (healthy.rank, healthy.pid, healthy.healthy) == (1, children[1].pid, True)
            assert healthy.process_state in AWAKE
            assert "spin_in_named_function" in healthy.stack_dump
            assert healthy.error == ""
        finally:
            for child in children:
                child.send_signal(signal.SIGCONT)
                child.kill()
                await asyncio.wait_for(child.wait(), 10)
