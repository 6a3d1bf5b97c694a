"""Running an external command (py-spy, scontrol, kubectl) from asyncio: to its end, or killed.

One runner for the agent and the coordinator: the command gets its own
session so a timeout or a cancellation kills whatever it started too, and
every way it can go wrong (missing, not startable, nonzero exit, too slow)
comes back as data, never as an exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

# After SIGKILL of a timed-out command, wait this long for it to be reaped.
KILL_WAIT_S = 5.0
# Longest stderr line quoted in a failure.
QUOTE_CHARS = 200
# A klog line ("E1121 17:28:38.573130   26919 memcache.go:265] ..."): kubectl's
# own error comes after such lines.
_KLOG_LINE = re.compile(r"[IWEF][0-9]{4} [0-9:.]+ +[0-9]+ [^ ]+:[0-9]+\] ")


@dataclasses.dataclass(frozen=True)
class CommandRun:
    """One finished (or abandoned) run of an external command.

    Attributes:
        argv: the command line.
        returncode: its exit status; None when it never ran or was killed at the timeout.
        stdout / stderr: what it wrote.
        failure: '' when it exited 0, else one line saying why not.
        not_found: the executable does not exist.
        timed_out: it was killed at the timeout.
    """

    argv: tuple[str, ...]
    returncode: int | None
    stdout: str
    failure: str
    stderr: str = ""
    not_found: bool = False
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return not self.failure

    def shown(self) -> str:
        """The command line for people: the executable's name and its arguments."""
        return " ".join([Path(self.argv[0]).name, *self.argv[1:]])


async def run_command(
    argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None
) -> CommandRun:
    """Run a command to its end, or kill it (and its process group) at ``timeout_s``.

    Never raises for the command's sake: a missing executable, a nonzero exit
    or the timeout is a CommandRun with ``failure`` set. Cancellation kills it too.
    """
    args = tuple(argv)
    name = Path(args[0]).name
    try:
        # Its own session, so a timeout kills whatever it started too: those
        # would otherwise hold the output pipes open and the wait with them.
        process = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            env=None if env is None else dict(env),
        )
    except FileNotFoundError:
        where = args[0] if os.sep in args[0] else f"{args[0]!r} on PATH"
        return CommandRun(args, None, "", f"{name} not found (looked for {where})", not_found=True)
    except OSError as exc:
        return CommandRun(args, None, "", f"{name} could not start: {exc.strerror or exc}")
    try:
        async with asyncio.timeout(timeout_s):
            stdout_bytes, stderr_bytes = await process.communicate()
    except TimeoutError:
        await _kill(process)
        return CommandRun(args, None, "", f"no answer within {timeout_s:g} s (killed)", timed_out=True)
    except asyncio.CancelledError:  # leave nothing running
        await _kill(process)
        raise
    stdout = stdout_bytes.decode(errors="replace")
    stderr = stderr_bytes.decode(errors="replace")
    returncode = process.returncode
    if returncode == 0:
        return CommandRun(args, 0, stdout, "", stderr)
    said = first_line(stderr) or first_line(stdout) or "no output"
    return CommandRun(args, returncode, stdout, f"exit {returncode}: {said}", stderr)


async def _kill(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    try:
        async with asyncio.timeout(KILL_WAIT_S):
            await process.wait()
    except TimeoutError:
        logger.warning("pid %d did not go away within %.0f s of SIGKILL", process.pid, KILL_WAIT_S)


def first_line(text: str) -> str:
    """The first line worth quoting (past klog prefixes), cut to QUOTE_CHARS."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = next((line for line in lines if not _KLOG_LINE.match(line)), lines[0] if lines else "")
    return line if len(line) <= QUOTE_CHARS else line[: QUOTE_CHARS - 3] + "..."
