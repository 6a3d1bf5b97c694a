"""The Kubernetes adapter: ``kubectl cordon`` of each excluded node, then ``kubectl delete pod`` of the job's pods.

Their controller (Job, PyTorchJob, JobSet) recreates them on schedulable nodes.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Sequence

from clusterwatch.coordinator.recovery.launchers.protocol import (
    COMMAND_TIMEOUT_S,
    LaunchOutcome,
    bad_node_names,
    describe_failure,
    unique,
)
from clusterwatch.errors import ConfigError
from clusterwatch.runtime.external_commands import CommandRun, run_command
from clusterwatch.wire.recovery_names import KUBERNETES

logger = logging.getLogger(__name__)

POD_SELECTOR_KEY = "recovery.kubernetes_pod_selector"
NAMESPACE_KEY = "recovery.kubernetes_namespace"

DEFAULT_POD_SELECTOR = "clusterwatch.io/job={job}"

# A Kubernetes label value (the job name in the default selector).
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?")
# A namespace name (an RFC 1123 label).
_NAMESPACE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


class KubernetesLauncher:
    """Restart a job that runs as Kubernetes pods by deleting them.

    The pods' controller (a Job, PyTorchJob or JobSet) creates them again;
    excluded nodes are cordoned first so the new pods cannot land there.
    Node ids are Kubernetes node names.

    Args:
        namespace: the job's namespace; '' uses kubectl's current context's.
        pod_selector: label selector of a job's pods; ``{job}`` is replaced by
            the job name.
        kubectl: the kubectl executable, a path or a name on PATH.
        command_timeout_s: the longest one kubectl call may take.

    Raises:
        ConfigError: ``pod_selector`` is empty or has a placeholder other than ``{job}``.
    """

    name: str = KUBERNETES
    replaces_nodes: bool = True

    def __init__(
        self,
        *,
        namespace: str = "",
        pod_selector: str = DEFAULT_POD_SELECTOR,
        kubectl: str = "kubectl",
        command_timeout_s: float = COMMAND_TIMEOUT_S,
    ) -> None:
        try:
            example = pod_selector.format(job="job")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                POD_SELECTOR_KEY, f"{pod_selector!r}: only {{job}} may be substituted ({exc})"
            ) from None
        if not example.strip():
            raise ConfigError(
                POD_SELECTOR_KEY, "must not be empty: it would select every pod in the namespace"
            )
        if namespace and not _NAMESPACE.fullmatch(namespace):
            raise ConfigError(NAMESPACE_KEY, f"{namespace!r} is not a Kubernetes namespace name")
        self._namespace = namespace
        self._pod_selector = pod_selector
        self._kubectl = kubectl
        self._timeout_s = command_timeout_s

    def selector_for(self, job: str) -> str:
        """The label selector of ``job``'s pods."""
        return self._pod_selector.format(job=job)

    async def restart(
        self, job: str, nodes: Sequence[str], exclude_nodes: Sequence[str], reason: str
    ) -> LaunchOutcome:
        started = time.monotonic()
        if "{job}" in self._pod_selector and not (job and _LABEL_VALUE.fullmatch(job)):
            return LaunchOutcome(False, f"job name {job!r} is not a Kubernetes label value; nothing done")
        excluded = unique(exclude_nodes)
        if bad := bad_node_names(excluded):
            return LaunchOutcome(
                False, f"not a Kubernetes node name: {', '.join(map(repr, bad))}; nothing done"
            )
        selector = self.selector_for(job)
        where = f"namespace {self._namespace}" if self._namespace else "kubectl's default namespace"
        logger.info(
            "restarting job %s: deleting pods %s in %s (%d nodes, %d cordoned first): %s",
            job,
            selector,
            where,
            len(nodes),
            len(excluded),
            reason,
        )
        cordons = await asyncio.gather(*(self._kubectl_run("cordon", node) for node in excluded))
        per_node = {
            node: "cordoned" if run.ok else f"not cordoned: {describe_failure(run)}"
            for node, run in zip(excluded, cordons, strict=True)
        }
        if failed := [(node, run) for node, run in zip(excluded, cordons, strict=True) if not run.ok]:
            problems = "; ".join(f"{node}: {describe_failure(run)}" for node, run in failed)
            return LaunchOutcome(
                False,
                f"cordoned {len(excluded) - len(failed)}/{len(excluded)} nodes, so no pods of job {job!r} "
                f"were deleted; {problems}",
                per_node,
            )
        namespace = [f"--namespace={self._namespace}"] if self._namespace else []
        delete = await self._kubectl_run(
            "delete", "pod", *namespace, f"--selector={selector}", "--wait=false", "--output=name"
        )
        if not delete.ok:
            return LaunchOutcome(
                False, f"pods of job {job!r} not deleted: {describe_failure(delete)}", per_node
            )
        deleted = [line for line in delete.stdout.split() if line.startswith("pod/")]
        if not deleted:
            return LaunchOutcome(
                False, f"no pods match {selector} in {where}: nothing to restart for job {job!r}", per_node
            )
        return LaunchOutcome(
            True,
            f"deleted {len(deleted)} pods of job {job!r} ({selector} in {where}) for their controller to "
            f"recreate; cordoned {len(excluded)} nodes first; {len(excluded) + 1} kubectl calls "
            f"in {time.monotonic() - started:.1f} s",
            per_node,
        )

    async def _kubectl_run(self, *args: str) -> CommandRun:
        return await run_command([self._kubectl, *args], self._timeout_s)
