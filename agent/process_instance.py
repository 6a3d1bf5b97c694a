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
import os
from pathlib import Path

# Parents that are never a worker's launcher: init systems and container inits
# (a process whose launcher died is adopted by one of them).
INIT_NAMES = frozenset({"init", "systemd", "tini", "dumb-init", "docker-init", "catatonit", "s6-svscan"})


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessInstance:
    """A process as /proc shows it now.

    Attributes:
        pid: in the agent's pid namespace.
        start_ticks: when it started, in clock ticks since boot.
        uid: its effective user id.
        name: its command name (``comm``), "" when not read.
        parent_pid: its parent's pid then (0: none).
    """

    pid: int
    start_ticks: int
    uid: int
    name: str = dataclasses.field(default="", compare=False)
    parent_pid: int = dataclasses.field(default=0, compare=False)


@dataclasses.dataclass(frozen=True, slots=True)
class VerifiedProcess:
    """What the agent learned of a hook's process from the kernel, not from the hook.

    Attributes:
        uid: from SO_PEERCRED.
        start_ticks: when the process started (None: not read).
        slurm_job_id: the SLURM job whose cgroup holds it (agent/slurm_cgroup.py); "" if none.
        launcher: its parent when it registered, unless that is an init (see ``launcher_of``).
    """

    uid: int
    start_ticks: int | None = None
    slurm_job_id: str = ""
    launcher: ProcessInstance | None = None


def read_instance(pid: int, proc_root: Path = Path("/proc")) -> ProcessInstance | None:
    """The process holding ``pid`` now; None when there is none (or /proc cannot be read)."""
    base = proc_root / str(pid)
    try:
        stat = (base / "stat").read_bytes()
        status = (base / "status").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': split after the last one.
    close = stat.rfind(b")")
    fields = stat[close + 2 :].split()
    try:
        start_ticks = int(fields[19])  # field 22 overall; fields[0] is field 3 (state)
        parent_pid = int(fields[1])
        uid = next(int(line.split()[2]) for line in status.splitlines() if line.startswith("Uid:"))
    except (IndexError, ValueError, StopIteration):
        return None
    name = stat[stat.find(b"(") + 1 : close].decode(errors="replace")
    return ProcessInstance(pid, start_ticks, uid, name, parent_pid)


def launcher_of(process: ProcessInstance, proc_root: Path = Path("/proc")) -> ProcessInstance | None:
    """The process that launched ``process``: its parent, unless that is an init (pid 1, a
    container's init, a subreaper init) or this agent, which launch nothing that could die alone."""
    parent_pid = process.parent_pid
    if parent_pid <= 1 or parent_pid == os.getpid():
        return None
    parent = read_instance(parent_pid, proc_root)
    if parent is None or parent.name in INIT_NAMES or parent.name.startswith("containerd-shim"):
        return None
    return parent


def still_running(instance: ProcessInstance, proc_root: Path = Path("/proc")) -> bool:
    """Whether ``instance`` still holds its pid (not exited, the pid not taken by another process)."""
    now = read_instance(instance.pid, proc_root)
    return now is not None and now.start_ticks == instance.start_ticks
