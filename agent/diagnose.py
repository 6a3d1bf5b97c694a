"""Examine training processes of a hung job: their scheduler state and, on request, a py-spy dump.

Only processes registered on the agent's hook socket are ever examined: the
caller (CommandHandler) resolves ranks to pids through the rank registry and
hands this module those pids alone. Every failure (the process is gone,
stopped, unreadable; py-spy is missing, fails or hangs) becomes the
diagnosis's ``error``, never an exception.

A stopped process (``kill -STOP``, Ctrl-Z, a debugger) cannot be dumped the
usual way: py-spy's blocking dump pauses the process through ptrace and fails
("Failed to suspend process: unexpected waitpid result ... SIGSTOP"). It is
already paused, though, so ``py-spy dump --nonblocking`` reads a consistent
stack from its memory: that is what a stopped process gets. A zombie or dead
process is reported from its state alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import psutil

from clusterwatch.runtime.external_commands import run_command
from clusterwatch.v1 import training_pb2

logger = logging.getLogger(__name__)

DEFAULT_DUMP_TIMEOUT_S = 5.0
# A dump larger than this (thousands of threads) is cut; the head is the useful part.
MAX_STACK_DUMP_CHARS = 1024 * 1024
MAX_ERROR_CHARS = 300
# States in which there is nothing to attach to, with what to tell the coordinator instead.
_UNDUMPABLE_STATES = {
    psutil.STATUS_ZOMBIE: "process is a zombie (it exited; its parent has not reaped it); nothing to dump",
    psutil.STATUS_DEAD: "process is dead; nothing to dump",
}


@dataclasses.dataclass(frozen=True, slots=True)
class DiagnosisTarget:
    """One registered training process to examine.

    Attributes:
        rank: the process's global rank in its job.
        pid: its pid, as registered on the hook socket.
        healthy: asked about for contrast, not as a suspect.
    """

    rank: int
    pid: int
    healthy: bool = False


def find_py_spy() -> Path | None:
    """py-spy next to this interpreter (the agent's virtual environment) first, then on PATH."""
    found = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    return Path(found) if found else None


class ProcessDiagnoser:
    """Reads the state and the Python stacks of training processes.

    Args:
        py_spy: the py-spy executable; None: look it up (``find_py_spy``) on every command.
        dump_timeout_s: how long one ``py-spy dump`` may take before it is killed.
    """

    def __init__(self, py_spy: Path | None = None, dump_timeout_s: float = DEFAULT_DUMP_TIMEOUT_S) -> None:
        if dump_timeout_s <= 0:
            raise ValueError(f"dump_timeout_s must be positive, got {dump_timeout_s}")
        self._py_spy = py_spy
        self.dump_timeout_s = dump_timeout_s

    async def diagnose(
        self, job: str, targets: Sequence[DiagnosisTarget], stack_dump: bool
    ) -> list[training_pb2.ProcessDiagnosis]:
        """Examine every target at once (one slow dump does not hold up the others).

        Returns:
            One diagnosis per target, in the targets' order; ``node_id`` is left for the coordinator.
        """
        py_spy = (self._py_spy or find_py_spy()) if stack_dump else None
        return list(await asyncio.gather(*(self._examine(job, t, stack_dump, py_spy) for t in targets)))

    async def _examine(
        self, job: str, target: DiagnosisTarget, stack_dump: bool, py_spy: Path | None
    ) -> training_pb2.ProcessDiagnosis:
        diagnosis = training_pb2.ProcessDiagnosis(
            job=job, rank=target.rank, pid=target.pid, healthy=target.healthy
        )
        try:
            diagnosis.process_state = psutil.Process(target.pid).status()
        except psutil.NoSuchProcess:
            diagnosis.error = f"process {target.pid} no longer exists"
            return diagnosis
        except psutil.AccessDenied:
            diagnosis.error = f"access denied reading the state of process {target.pid}"
            return diagnosis
        if not stack_dump:
            return diagnosis
        undumpable = _UNDUMPABLE_STATES.get(diagnosis.process_state)
        if undumpable is not None:
            diagnosis.error = undumpable
        elif py_spy is None:
            diagnosis.error = "py-spy is not installed (not next to the agent's python nor on PATH)"
        else:
            # Already paused: reading it without pausing it again is consistent.
            nonblocking = diagnosis.process_state in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
            dump, error = await self._dump(py_spy, target.pid, nonblocking)
            diagnosis.stack_dump, diagnosis.error = dump, error
        if diagnosis.error:
            logger.info(
                "no stack of rank %d of job %s (pid %d): %s", target.rank, job, target.pid, diagnosis.error
            )
        return diagnosis

    async def _dump(self, py_spy: Path, pid: int, nonblocking: bool) -> tuple[str, str]:
        """``py-spy dump --pid`` (``--nonblocking`` for a stopped process): (the dump, "") or ("", why it failed)."""
        # The agent may run with RUST_BACKTRACE set; a Rust backtrace on stderr is noise here.
        env = {**os.environ, "RUST_BACKTRACE": "0", "RUST_LIB_BACKTRACE": "0"}
        argv = [str(py_spy), "dump", "--pid", str(pid), *(["--nonblocking"] if nonblocking else [])]
        run = await run_command(argv, self.dump_timeout_s, env=env)
        if run.not_found:
            return "", f"py-spy is not installed (no file {py_spy})"
        if run.timed_out:
            return "", f"py-spy timed out after {self.dump_timeout_s:g} s"
        if run.returncode is None:
            return "", f"cannot run py-spy at {py_spy}: {run.failure}"
        if run.returncode != 0:
            return "", "py-spy failed: " + _py_spy_error(run.stderr, run.returncode)
        if len(run.stdout) > MAX_STACK_DUMP_CHARS:
            cut = run.stdout[:MAX_STACK_DUMP_CHARS]
            return cut + f"\n... (cut at {MAX_STACK_DUMP_CHARS} of {len(run.stdout)} characters)\n", ""
        return run.stdout, ""


def _py_spy_error(stderr: str, returncode: int | None) -> str:
    """py-spy's error and its causes on one line.

    py-spy (anyhow) writes ``Error: <what>``, then ``Caused by:`` and indented
    ``N: <cause>`` lines; its first line alone is often just "Failed to get
    stack traces".
    """
    parts: list[str] = []
    for raw in stderr.splitlines():
        line = raw.strip()
        if line.startswith("Stack backtrace:"):
            break
        if not line or line == "Caused by:":
            continue
        line = line.removeprefix("Error:").strip()
        index, colon, rest = line.partition(": ")
        if colon and index.isdigit():
            line = rest
        if line not in parts:
            parts.append(line)
    message = ": ".join(parts) or f"exit status {returncode}"
    if len(message) > MAX_ERROR_CHARS:
        message = message[: MAX_ERROR_CHARS - 3] + "..."
    return message
