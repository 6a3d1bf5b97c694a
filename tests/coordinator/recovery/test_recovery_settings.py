"""[recovery] settings in a real coordinator process: the launcher they choose restarts a
job, SIGHUP re-reads them (the policy's at once, the launcher's only at the next start),
and a bad reload changes nothing."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
from helpers import Cluster, Coordinator, job_status, wait_for
from training_builders import AgentStream, rank_report, step

from clusterwatch.v1 import cluster_pb2

pytestmark = pytest.mark.timeout(60)

# Numeric, so the SLURM launcher takes the job name as its SLURM job id.
JOB = "4242"
STEPS = [step(n) for n in range(1, 6)]

SCONTROL_STANDIN = """#!{python}
# STAND-IN for `scontrol`, written by tests/coordinator/recovery/test_recovery_settings.py: not the real tool.
# Appends its arguments as one JSON line to {calls!r} and succeeds.
import json, sys
with open({calls!r}, "a") as calls:
    calls.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def write_scontrol(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "scontrol"
    path.parent.mkdir()
    path.write_text(SCONTROL_STANDIN.format(python=sys.executable, calls=str(path) + ".calls"))
    path.chmod(0o755)
    return path


def scontrol_calls(scontrol: Path) -> list[list[str]]:
    calls = Path(str(scontrol) + ".calls")
    return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []


def write_recovery(config: Path, **settings: object) -> None:
    """``config`` with a [recovery] table of ``settings``; the policy leaves JOB alone
    (its incidents would restart it), so only the test's restarts reach the launcher."""
    settings = {"opt_out_jobs": [JOB], **settings}
    config.write_text(
        "[recovery]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in settings.items())
    )


def restart(coordinator: Coordinator) -> cluster_pb2.ActionResponse:
    with coordinator.client() as client:
        return client.restart(JOB)


def reload(coordinator: Coordinator, log_line: str) -> None:
    """SIGHUP, then wait for one more ``log_line`` than before in the coordinator's log."""
    before = coordinator.log().count(log_line)
    coordinator.signal(signal.SIGHUP)
    wait_for(lambda: coordinator.log().count(log_line) > before, 20, f"{log_line!r} after SIGHUP")


APPLIED = "recovery settings now"
REJECTED = "SIGHUP: kept the recovery settings in force; invalid configuration"


async def test_sighup_rereads_recovery_settings_but_keeps_the_launcher(
    cluster: Cluster, tmp_path: Path
) -> None:
    scontrol = write_scontrol(tmp_path)
    config = tmp_path / "clusterwatch.toml"
    write_recovery(config, launcher="slurm", scontrol=str(scontrol))
    coordinator = cluster.coordinator("--config", str(config))
    async with AgentStream(coordinator.address, "node-a") as node:
        ranks = [rank_report(rank, job=JOB, steps=STEPS) for rank in range(2)]
        for report in ranks:  # the agent found the processes in SLURM job JOB's cgroup
            report.slurm_job_id = JOB
        await node.report(*ranks)
        wait_for(lambda: job_status(coordinator, JOB), 20, f"job {JOB} in the snapshot")

        # The configured launcher: SLURM, through the configured scontrol.
        first = restart(coordinator)
        assert first.message.startswith(f"done: requeued SLURM job {JOB} (job '{JOB}' on 1 nodes)"), first
        assert scontrol_calls(scontrol) == [["requeue", JOB]]

        # A policy setting applies at once: dry run, so nothing is requeued.
        write_recovery(config, launcher="slurm", scontrol=str(scontrol), dry_run=True)
        reload(coordinator, APPLIED)
        assert restart(coordinator).message == f"done: dry run: would restart job {JOB}"
        assert scontrol_calls(scontrol) == [["requeue", JOB]]

        # Another launcher needs a restart of the coordinator: the SLURM one stays, the rest applies.
        write_recovery(config, launcher="kubernetes", dry_run=False)
        reload(coordinator, APPLIED)
        log = coordinator.log()
        assert "restart the coordinator to apply launcher 'slurm' -> 'kubernetes'" in log
        assert restart(coordinator).message.startswith(f"done: requeued SLURM job {JOB}")
        assert scontrol_calls(scontrol) == [["requeue", JOB]] * 2

        # Invalid: a bad value, or a bad option of the launcher asked for; nothing changes.
        for bad, key in (
            ({"hang_action": "reboot"}, "recovery.hang_action"),
            ({"launcher": "slurm", "slurm_job_ids": ["llama=x"]}, "recovery.slurm_job_ids"),
            (
                {"launcher": "kubernetes", "kubernetes_pod_selector": "job={name}"},
                "recovery.kubernetes_pod_selector",
            ),
        ):
            applied = coordinator.log().count(APPLIED)
            write_recovery(config, scontrol=str(scontrol), dry_run=True, **bad)
            reload(coordinator, REJECTED)
            rejection = coordinator.log().split(REJECTED)[-1].splitlines()[0]
            assert key in rejection, rejection
            assert coordinator.log().count(APPLIED) == applied
        assert restart(coordinator).message.startswith(f"done: requeued SLURM job {JOB}")  # not a dry run
        assert len(scontrol_calls(scontrol)) == 3
