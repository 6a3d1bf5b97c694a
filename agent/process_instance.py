"""One process, not one pid: a pid plus the kernel's start time of the process holding it.

Pids are reused. A hook's credential nonce is issued to the process that
connected; if that process exits and another (root's, say) takes its pid
before the nonce is redeemed, the pid alone would register the newcomer as
the rank, and a later stop would signal it. So the agent records the
process's start time (``/proc/PID/stat`` field 22, clock ticks since boot,
which never changes for a process and differs for the next holder of the
pid) when it issues the nonce, checks it again when the nonce is redeemed,
keeps it with the registered rank, and checks it once more before a stop
signals the pid. The user id is read too: a process that is not the uid the
kernel reported for the socket is another process already.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessInstance:
    """A process as /proc shows it now.

    Attributes:
        pid: in the agent's pid namespace.
        start_ticks: when it started, in clock ticks since boot.
        uid: its effective user id.
    """

    pid: int
    start_ticks: int
    uid: int


def read_instance(pid: int, proc_root: Path = Path("/proc")) -> ProcessInstance | None:
    """The process holding ``pid`` now; None when there is none (or /proc cannot be read)."""
    base = proc_root / str(pid)
    try:
        stat = (base / "stat").read_bytes()
        status = (base / "status").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': split after the last one.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        start_ticks = int(fields[19])  # field 22 overall; fields[0] is field 3 (state)
        uid = next(int(line.split()[2]) for line in status.splitlines() if line.startswith("Uid:"))
    except (IndexError, ValueError, StopIteration):
        return None
    return ProcessInstance(pid, start_ticks, uid)


def still_running(instance: ProcessInstance, proc_root: Path = Path("/proc")) -> bool:
    """Whether ``instance`` still holds its pid (not exited, the pid not taken by another process)."""
    now = read_instance(instance.pid, proc_root)
    return now is not None and now.start_ticks == instance.start_ticks
