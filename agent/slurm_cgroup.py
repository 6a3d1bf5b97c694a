"""The SLURM job a process runs in, from where slurmd put it: its cgroup, not its environment.

A process can set ``SLURM_JOB_ID`` to anything, and a hook can label its rank
with anything; the SLURM launcher must never ``scontrol requeue`` a job on
that word. slurmstepd places every task of a job under a cgroup named after
the job, which only root can create or move processes into:

- cgroup v2: ``0::/system.slice/slurmstepd.scope/job_4301/step_0/user/task_0``
  (``<nodename>_slurmstepd.scope`` with several slurmd on one host; the scope
  may sit under other slices);
- cgroup v1: ``4:memory:/slurm/uid_1000/job_4301/step_0/task_0``
  (``slurm_<nodename>`` with several slurmd on one host).

Users can create cgroups where they are delegated one: below a job's step
(v2), and in their own systemd manager (``user@UID.service``). So the path
must start at the root with nothing but slices before slurmstepd's scope (a
user's ``.../user@1000.service/slurmstepd.scope/job_777`` is not one), and
only the ``job_N`` right under that scope counts, not a ``job_777`` the user
made below the step.
"""

from __future__ import annotations

import re
from pathlib import Path

# From the hierarchy's root: only slices, then slurmstepd's scope (v2), or slurm's uid_N (v1), then the job.
_SLURM_JOB_CGROUP = re.compile(
    r"/(?:[^/]+\.slice/)*(?:[^/]+_)?slurmstepd\.scope/job_([0-9]+)(?:/|$)"
    r"|/slurm(?:_[^/]+)?/uid_[0-9]+/job_([0-9]+)(?:/|$)"
)


def slurm_job_of(pid: int, proc_root: Path = Path("/proc")) -> str:
    """The SLURM job id whose cgroup holds ``pid``; '' outside SLURM (or when /proc cannot tell)."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        match = _SLURM_JOB_CGROUP.match(path)
        if match is not None:
            return match.group(1) or match.group(2)
    return ""
