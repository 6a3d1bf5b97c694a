"""Profiling metrics (NVML GPU Performance Monitoring, Hopper and newer) and throttle violation times.

GPM is what dcgm-exporter's ``DCGM_FI_PROF_*`` defaults are made of, read
through NVML without DCGM: each report takes a GPM sample of each GPU and asks
``nvmlGpmMetricsGet`` for the share of the interval since the previous sample
that the graphics engine, the SMs, their warp slots, the tensor pipes and the
DRAM interface were busy (NVML says percent; we say ratios). Where a GPU does
not support GPM (``nvmlGpmQueryDeviceSupport``), or a call fails, the fields
stay unset and the failure is counted like every other NVML query's
(NvmlQueries); a metric NVML does not compute on this GPU comes back with its
own error code and is left unset alone.

``nvmlDeviceGetViolationStatus`` gives, per reason, the time since the driver
loaded that the clocks were held down (nanoseconds): counters, so rate() says
what share of a window was lost to power or thermal limits.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from clusterwatch.agent.gpu.nvml_queries import NvmlQueries
from clusterwatch.v1 import node_pb2

logger = logging.getLogger(__name__)

# GpuSample field -> the NVML GPM metric that fills it.
GPM_METRICS = (
    ("graphics_active_ratio", "NVML_GPM_METRIC_GRAPHICS_UTIL"),
    ("sm_active_ratio", "NVML_GPM_METRIC_SM_UTIL"),
    ("sm_occupancy_ratio", "NVML_GPM_METRIC_SM_OCCUPANCY"),
    ("tensor_active_ratio", "NVML_GPM_METRIC_ANY_TENSOR_UTIL"),
    ("dram_active_ratio", "NVML_GPM_METRIC_DRAM_BW_UTIL"),
)
# ThrottleViolation.reason -> NVML's perf policy.
VIOLATION_POLICIES = (
    ("power", "NVML_PERF_POLICY_POWER"),
    ("thermal", "NVML_PERF_POLICY_THERMAL"),
    ("sync_boost", "NVML_PERF_POLICY_SYNC_BOOST"),
    ("board_limit", "NVML_PERF_POLICY_BOARD_LIMIT"),
    ("low_utilization", "NVML_PERF_POLICY_LOW_UTILIZATION"),
    ("reliability", "NVML_PERF_POLICY_RELIABILITY"),
    ("app_clocks", "NVML_PERF_POLICY_TOTAL_APP_CLOCKS"),
    ("base_clocks", "NVML_PERF_POLICY_TOTAL_BASE_CLOCKS"),
)
NS_PER_S = 1e9


@dataclasses.dataclass
class GpmState:
    """One GPU's two GPM sample buffers: the previous reading and the one taken next."""

    previous: Any
    current: Any
    primed: bool = False


class GpmReader:
    """Reads GPM metrics and violation times into GpuSamples, one GPU at a time.

    Args:
        nvml: the pynvml module (or the fake with its API).
        queries: where every call goes through, so failures are counted and
            permanent ones switch a query off for that GPU.
    """

    def __init__(self, nvml: Any, queries: NvmlQueries) -> None:
        self._nvml = nvml
        self._queries = queries
        self._metric_ids = [(name, getattr(nvml, constant, None)) for name, constant in GPM_METRICS]
        self._policies = [(reason, getattr(nvml, constant, None)) for reason, constant in VIOLATION_POLICIES]

    def prepare(self, index: int, handle: Any) -> GpmState | None:
        """The GPU's sample buffers, or None when it has no GPM (or this pynvml lacks it)."""
        if not hasattr(self._nvml, "nvmlGpmQueryDeviceSupport"):
            return None
        support = self._queries.call(index, "nvmlGpmQueryDeviceSupport", handle)
        if support is None:
            return None
        if not support.isSupportedDevice:  # before Hopper: said once, counted as unsupported
            self._queries.count("nvmlGpmQueryDeviceSupport", "NotSupported")
            return None
        first = self._queries.call(index, "nvmlGpmSampleAlloc", variant="first")
        second = self._queries.call(index, "nvmlGpmSampleAlloc", variant="second")
        if first is None or second is None:
            self._free(index, first, second)
            return None
        return GpmState(previous=first, current=second)

    def fill(self, index: int, handle: Any, state: GpmState | None, sample: node_pb2.GpuSample) -> None:
        """Set the GPM ratios (from the second call on) and the violation counters of ``sample``."""
        self._fill_violations(index, handle, sample)
        if state is None:
            return
        if not self._queries.succeeded(index, "nvmlGpmSampleGet", handle, state.current):
            return
        if state.primed:
            self._fill_metrics(index, state, sample)
        state.previous, state.current = state.current, state.previous
        state.primed = True

    def close(self, index: int, state: GpmState | None) -> None:
        if state is not None:
            self._free(index, state.previous, state.current)

    def _fill_metrics(self, index: int, state: GpmState, sample: node_pb2.GpuSample) -> None:
        wanted = [(name, metric_id) for name, metric_id in self._metric_ids if metric_id is not None]
        request = self._nvml.c_nvmlGpmMetricsGet_t()
        request.version = self._nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(wanted)
        request.sample1 = state.previous
        request.sample2 = state.current
        for i, (_, metric_id) in enumerate(wanted):
            request.metrics[i].metricId = metric_id
        answer = self._queries.call(index, "nvmlGpmMetricsGet", request)
        if answer is None:
            return
        for i, (name, _) in enumerate(wanted):
            metric = answer.metrics[i]
            if metric.nvmlReturn == self._nvml.NVML_SUCCESS:
                setattr(sample, name, min(1.0, max(0.0, float(metric.value) / 100.0)))

    def _fill_violations(self, index: int, handle: Any, sample: node_pb2.GpuSample) -> None:
        for reason, policy in self._policies:
            if policy is None:
                continue
            time = self._queries.call(index, "nvmlDeviceGetViolationStatus", handle, policy, variant=reason)
            if time is not None:
                sample.throttle_violations.add(reason=reason, seconds_total=time.violationTime / NS_PER_S)

    def _free(self, index: int, *samples: Any) -> None:
        for buffer in samples:
            if buffer is not None:
                self._queries.succeeded(index, "nvmlGpmSampleFree", buffer)
