"""Launcher adapters: how the coordinator restarts a job, behind one interface.

A restart stops the job where it runs and lets the site's own launcher start it
again, from its last complete checkpoint; with ``exclude_nodes`` the restarted
job must not use those nodes. Three adapters:

- ``TorchrunLauncher``: every node's agent stops the job's local workers
  (StopWorkersCommand) and torchrun restarts the worker group
  (``--max-restarts``). On an excluded node the agent stops torchrun too and
  cordons the node, so an elastic job re-forms without it.
- ``SlurmLauncher``: ``scontrol requeue`` of the job's SLURM batch job. The
  SLURM job id comes from ``recovery.slurm_job_ids``, else from what can be
  verified: the SLURM job whose cgroup holds the job's ranks (each node's agent
  reads it, agent/slurm_cgroup.py) or the one an admin registered the job with
  (BeginJob, the SLURM Prolog). Never from a label a rank gives itself or from
  the job's name: those are the user's word, and a requeue of someone else's
  job on it is an attack. To exclude nodes: ``scontrol requeuehold``,
  ``scontrol update JobId=.. ExcNodeList=..`` while the job is held
  (slurmctld only changes ExcNodeList on a pending job), then ``scontrol
  release``.
- ``KubernetesLauncher``: ``kubectl cordon`` of each excluded node, then
  ``kubectl delete pod`` of the job's pods; their controller (Job,
  PyTorchJob, JobSet) recreates them on schedulable nodes.

Failure is data: a launcher never raises for what it could not do (a node that
does not answer, a command that exits nonzero, is missing or runs too long); it
returns a LaunchOutcome with ``ok=False`` and says why in one line.

One module per adapter (``torchrun``, ``slurm``, ``kubernetes``), the interface
they share in ``protocol``, and ``registry`` to build the one the settings name.
"""

from clusterwatch.coordinator.recovery.launchers.kubernetes import DEFAULT_POD_SELECTOR
from clusterwatch.coordinator.recovery.launchers.protocol import (
    Launcher,
    LaunchOutcome,
    SendStop,
    VerifiedSlurmJobs,
)
from clusterwatch.coordinator.recovery.launchers.registry import LAUNCHER_KEY, make_launcher
from clusterwatch.coordinator.recovery.launchers.slurm import parse_slurm_job_ids

__all__ = [
    "DEFAULT_POD_SELECTOR",
    "LAUNCHER_KEY",
    "LaunchOutcome",
    "Launcher",
    "SendStop",
    "VerifiedSlurmJobs",
    "make_launcher",
    "parse_slurm_job_ids",
]
