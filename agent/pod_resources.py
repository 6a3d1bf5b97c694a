"""Which Kubernetes container each GPU is assigned to, from the kubelet's pod-resources API.

The kubelet serves ``v1.PodResourcesLister`` on a Unix socket
(``/var/lib/kubelet/pod-resources/kubelet.sock``). Its ``List`` call returns
every pod on the node with, per container, the device ids the device plugins
handed out. For ``nvidia.com/gpu`` the NVIDIA device plugin's ids are GPU
UUIDs (``GPU-...``), the same UUIDs NVML reports, so a GPU sample is
attributed by its ``uuid``.

Only whole-GPU UUIDs are mapped. A time-slicing replica ``GPU-...::N`` names
its GPU before the ``::``. MIG instances (``MIG-...``) are not whole GPUs and
index ids (device plugin ``deviceIDStrategy=index``) cannot be told from
another node's, so both are ignored: those GPUs carry no pod labels. A GPU
shared by several containers (time-slicing) is attributed to the first of
them by (namespace, pod, container), so its series keep one stable identity.

Failure is data, not a crash: with no socket, or a kubelet that errs or does
not answer within ``timeout_s``, no GPU is attributed; each change between
working, absent and failing is logged once. The answer is cached and asked
again at most every ``refresh_s``, so a slow kubelet costs at most one
timeout per refresh, never one per report.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from clusterwatch.kubelet import podresources_v1_pb2, podresources_v1_pb2_grpc
from clusterwatch.runtime.grpc_options import CHANNEL_OPTIONS

logger = logging.getLogger(__name__)

# Resource names of whole NVIDIA GPUs: the device plugin's default, and its
# name for time-sliced GPUs when the plugin is told to rename them.
GPU_RESOURCE_NAMES = frozenset({"nvidia.com/gpu", "nvidia.com/gpu.shared"})
GPU_UUID_PREFIX = "GPU-"
REPLICA_SEPARATOR = "::"
DEFAULT_REFRESH_S = 5.0
DEFAULT_TIMEOUT_S = 1.0


@dataclass(frozen=True, order=True)
class PodRef:
    """The container a GPU is assigned to. Ordered by namespace, pod, container."""

    namespace: str
    pod: str
    container: str


def gpu_assignments(response: podresources_v1_pb2.ListPodResourcesResponse) -> dict[str, PodRef]:
    """GPU UUID -> the container it is assigned to, from one ``List`` answer.

    Devices of other resources, and ids that are not GPU UUIDs, are left out.
    """
    candidates: dict[str, list[PodRef]] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            ref = PodRef(namespace=pod.namespace, pod=pod.name, container=container.name)
            for devices in container.devices:
                if devices.resource_name not in GPU_RESOURCE_NAMES:
                    continue
                for uuid in _gpu_uuids(devices.device_ids):
                    candidates.setdefault(uuid, []).append(ref)
    return {uuid: min(refs) for uuid, refs in candidates.items()}


def _gpu_uuids(device_ids: Iterable[str]) -> Iterable[str]:
    for device_id in device_ids:
        uuid = device_id.split(REPLICA_SEPARATOR, 1)[0]
        if uuid.startswith(GPU_UUID_PREFIX):
            yield uuid


class PodResources:
    """GPU UUID -> container, from the kubelet, cached for ``refresh_s``.

    Args:
        socket_path: the kubelet's pod-resources socket.
        refresh_s: ask the kubelet again at most this often.
        timeout_s: the longest one ``List`` call may take.
        clock: monotonic seconds; injectable for tests.
    """

    def __init__(
        self,
        socket_path: Path,
        refresh_s: float = DEFAULT_REFRESH_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.socket_path = socket_path
        self._refresh_s = refresh_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._assignments: dict[str, PodRef] = {}
        self._next_refresh_s: float | None = None
        self._state = ""  # "ok", "absent" or "failing": logged when it changes

    def assignments(self) -> Mapping[str, PodRef]:
        """GPU UUID -> container; empty when the kubelet cannot be asked. Never raises.

        Blocks for up to ``timeout_s`` when the cache is due for a refresh:
        call it off the event loop, as collectors are.
        """
        now_s = self._clock()
        if self._next_refresh_s is None or now_s >= self._next_refresh_s:
            self._next_refresh_s = now_s + self._refresh_s
            self._assignments = self._refresh()
        return self._assignments

    def _refresh(self) -> dict[str, PodRef]:
        if not self.socket_path.exists():
            self._enter("absent", "no kubelet pod-resources socket at %s: GPU series carry no pod labels")
            return {}
        try:
            assignments = gpu_assignments(self._list())
        except Exception as exc:  # failure is data: attribution must never cost the GPU samples
            self._enter(
                "failing",
                "kubelet pod-resources List on %s failed (%s): GPU series carry no pod labels until it answers",
                _reason(exc),
            )
            return {}
        self._enter(
            "ok", "kubelet pod-resources on %s answers: %d GPUs assigned to containers", len(assignments)
        )
        return assignments

    def _list(self) -> podresources_v1_pb2.ListPodResourcesResponse:
        # A fresh channel per refresh: no reconnect backoff left over from a
        # kubelet restart, and nothing held open between refreshes.
        with grpc.insecure_channel(f"unix:{self.socket_path}", options=CHANNEL_OPTIONS) as channel:
            stub = podresources_v1_pb2_grpc.PodResourcesListerStub(channel)
            response: podresources_v1_pb2.ListPodResourcesResponse = stub.List(
                podresources_v1_pb2.ListPodResourcesRequest(), timeout=self._timeout_s
            )
            return response

    def _enter(self, state: str, message: str, *args: object) -> None:
        """Log ``message`` once, when the state changes; failing logs a warning."""
        if state == self._state:
            return
        self._state = state
        level = logging.WARNING if state == "failing" else logging.INFO
        logger.log(level, message, self.socket_path, *args)


def _reason(exc: Exception) -> str:
    """One line for the log: the gRPC status of a failed call, else the exception."""
    if isinstance(exc, grpc.Call):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)
