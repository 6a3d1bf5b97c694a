"""Which SLURM job holds a process, from its cgroup as slurmstepd made it (agent/slurm_cgroup.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from clusterwatch.agent.slurm_cgroup import slurm_job_of

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    ("cgroup", "job"),
    [
        ("0::/system.slice/slurmstepd.scope/job_4301/step_0/user/task_0\n", "4301"),
        ("0::/system.slice/node7_slurmstepd.scope/job_12/step_batch/user/task_0\n", "12"),  # multiple slurmd
        ("0::/slurm.slice/slurmstepd.scope/job_12/step_batch/user/task_0\n", "12"),
        # v1: several controllers, one path each; slurm_<node> with several slurmd on a host.
        ("12:pids:/\n4:memory:/slurm/uid_1000/job_77/step_0/task_1\n", "77"),
        ("4:freezer:/slurm_gpu01/uid_1000/job_78/step_0\n", "78"),
        # A cgroup the user made below the delegated step, named like another job: the first counts.
        ("0::/system.slice/slurmstepd.scope/job_4301/step_0/user/job_777777/task_0\n", "4301"),
        # ... and what the user made in their own systemd manager counts for nothing, however named.
        ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/job_777777\n", ""),
        ("0::/user.slice/user-1000.slice/user@1000.service/slurmstepd.scope/job_777777/step_0\n", ""),
        ("0::/user.slice/user-1000.slice/user@1000.service/x.slice/slurm/uid_1000/job_777777\n", ""),
        ("0::/user.slice/user-1000.slice/session-3.scope\n", ""),
        ("0::/system.slice/slurmstepd.scope/job_/step_0\n", ""),
        ("", ""),
    ],
)
def test_the_job_comes_from_slurmstepd_s_cgroup_only(tmp_path: Path, cgroup: str, job: str) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text(cgroup)
    assert slurm_job_of(42, tmp_path) == job


def test_a_process_outside_slurm_or_gone_has_none(tmp_path: Path) -> None:
    assert slurm_job_of(os.getpid()) == ""  # this test does not run under slurmstepd
    assert slurm_job_of(42, tmp_path) == ""
