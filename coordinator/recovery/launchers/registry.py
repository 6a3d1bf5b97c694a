"""The launcher registry: each kind of ``recovery.launcher`` and how its adapter is built from the settings.

A new launcher is a module of its own in this package, with a builder here
and its kind in clusterwatch/wire/recovery_names.py (tests/coordinator/recovery/test_launchers.py
checks the two agree).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from clusterwatch.coordinator.recovery.launchers.kubernetes import DEFAULT_POD_SELECTOR, KubernetesLauncher
from clusterwatch.coordinator.recovery.launchers.protocol import (
    COMMAND_TIMEOUT_S,
    Launcher,
    SendStop,
    VerifiedSlurmJobs,
)
from clusterwatch.coordinator.recovery.launchers.slurm import SlurmLauncher
from clusterwatch.coordinator.recovery.launchers.torchrun import TorchrunLauncher
from clusterwatch.errors import ConfigError
from clusterwatch.wire.recovery_names import KUBERNETES, LAUNCHER_KINDS, SLURM, TORCHRUN

# Settings keys named in ConfigError (section [recovery]).
LAUNCHER_KEY = "recovery.launcher"


@dataclasses.dataclass(frozen=True)
class LauncherOptions:
    """Everything a builder may use: make_launcher's arguments (see there)."""

    send_stop: SendStop
    stop_grace_s: float
    slurm_job_ids: Mapping[str, str] | None
    verified_slurm_jobs: VerifiedSlurmJobs | None
    scontrol: str
    kubernetes_namespace: str
    kubernetes_pod_selector: str
    kubectl: str
    command_timeout_s: float


def _torchrun(options: LauncherOptions) -> Launcher:
    return TorchrunLauncher(options.send_stop, grace_s=options.stop_grace_s)


def _slurm(options: LauncherOptions) -> Launcher:
    return SlurmLauncher(
        job_ids=options.slurm_job_ids,
        verified_job_ids=options.verified_slurm_jobs,
        scontrol=options.scontrol,
        command_timeout_s=options.command_timeout_s,
    )


def _kubernetes(options: LauncherOptions) -> Launcher:
    return KubernetesLauncher(
        namespace=options.kubernetes_namespace,
        pod_selector=options.kubernetes_pod_selector,
        kubectl=options.kubectl,
        command_timeout_s=options.command_timeout_s,
    )


BUILDERS: Mapping[str, Callable[[LauncherOptions], Launcher]] = {
    TORCHRUN: _torchrun,
    SLURM: _slurm,
    KUBERNETES: _kubernetes,
}
"""Each launcher kind's builder."""


def make_launcher(
    kind: str,
    send_stop: SendStop,
    *,
    stop_grace_s: float = 10.0,
    slurm_job_ids: Mapping[str, str] | None = None,
    verified_slurm_jobs: VerifiedSlurmJobs | None = None,
    scontrol: str = "scontrol",
    kubernetes_namespace: str = "",
    kubernetes_pod_selector: str = DEFAULT_POD_SELECTOR,
    kubectl: str = "kubectl",
    command_timeout_s: float = COMMAND_TIMEOUT_S,
) -> Launcher:
    """The launcher adapter of ``kind``, with its options (the others are ignored).

    Args:
        kind: "torchrun", "slurm" or "kubernetes".
        send_stop: how the torchrun adapter reaches an agent (see SendStop).
        verified_slurm_jobs: the SLURM job ids verified for a job, for the SLURM adapter.

    Raises:
        ConfigError: an unknown kind, or a bad option of the chosen one.
    """
    build = BUILDERS.get(kind)
    if build is None:
        raise ConfigError(LAUNCHER_KEY, f"unknown launcher {kind!r} (one of: {', '.join(LAUNCHER_KINDS)})")
    return build(
        LauncherOptions(
            send_stop,
            stop_grace_s,
            slurm_job_ids,
            verified_slurm_jobs,
            scontrol,
            kubernetes_namespace,
            kubernetes_pod_selector,
            kubectl,
            command_timeout_s,
        )
    )
