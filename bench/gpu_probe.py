"""What the agent's NVML backend reads from a real GPU, and what NVML's GPM metrics offer beside it.

Usage (on a machine with an NVIDIA GPU and driver; prints, writes nothing):
    python -m bench.gpu_probe [--load-s 2]

1. ``NvmlBackend``: the driver version, one ``GpuSample`` per GPU (as sent to
   the coordinator), the time a ``sample()`` takes (median of 20) and which
   NVML calls that time goes to, the topology it reads, and the query errors
   it counted (calls the GPU refused).
2. GPM (``nvmlGpmMetricsGet``, Hopper and later): whether the GPU supports it,
   and the metrics ML engineers read (SM activity and occupancy, tensor-core
   activity, DRAM bandwidth, PCIe/NVLink traffic) over ``--load-s`` seconds
   while a bf16 matrix product keeps the GPU busy (torch, if it has CUDA),
   next to NVML's coarse ``utilization.gpu`` for the same interval. The agent
   does not read GPM yet: this says what it would get.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import pynvml

from clusterwatch.agent.gpu.nvml_backend import NvmlBackend

GPM_METRICS = {
    "graphics_util": pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL,
    "sm_util": pynvml.NVML_GPM_METRIC_SM_UTIL,
    "sm_occupancy": pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
    "any_tensor_util": pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    "hmma_tensor_util": pynvml.NVML_GPM_METRIC_HMMA_TENSOR_UTIL,
    "dram_bw_util": pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
    "fp32_util": pynvml.NVML_GPM_METRIC_FP32_UTIL,
    "fp16_util": pynvml.NVML_GPM_METRIC_FP16_UTIL,
    "pcie_tx_mib_per_s": pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC,
    "pcie_rx_mib_per_s": pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC,
    "nvlink_rx_mib_per_s": pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC,
    "nvlink_tx_mib_per_s": pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC,
}


class TimedNvml:
    """pynvml, with the wall time of every ``nvml*`` call added up by function name."""

    def __init__(self) -> None:
        self.seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        value = getattr(pynvml, name)
        if not (name.startswith("nvml") and callable(value)):
            return value
        return self._timed(name, value)

    def _timed(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started
                self.calls[name] += 1

        return timed


def probe_backend() -> None:
    nvml = TimedNvml()
    backend = NvmlBackend(nvml=nvml)  # type: ignore[arg-type]  # a stand-in with pynvml's API
    try:
        print(f"driver {backend.driver_version()}")
        samples = backend.sample()
        for sample in samples:
            print(f"--- GpuSample {sample.index}\n{sample}")
        took_ms = []
        nvml.seconds.clear()
        nvml.calls.clear()
        for _ in range(20):
            started = time.perf_counter()
            backend.sample()
            took_ms.append((time.perf_counter() - started) * 1e3)
        print(
            f"sample() of {len(samples)} GPUs: median {statistics.median(took_ms):.2f} ms, max {max(took_ms):.2f} ms"
        )
        topology = backend.topology()
        print(f"topology gpus: {[str(g).replace(chr(10), ' ') for g in topology.gpus]}")
        print(f"topology links: {[str(link).replace(chr(10), ' ') for link in topology.links]}")
        print(f"topology problems: {topology.problems}")
        for error in backend.query_errors():
            print(f"query error: {error.function} {error.error} x{error.count}")
    finally:
        backend.close()


def busy_gpu(seconds: float, started: threading.Event) -> str:
    """A bf16 matrix product in a loop for ``seconds``; what ran, as text."""
    try:
        import torch
    except ImportError:
        started.set()
        return "no torch: GPU idle"
    if not torch.cuda.is_available():
        started.set()
        return "torch without CUDA: GPU idle"
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    started.set()
    products = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(10):
            a @ a
        products += 10
        torch.cuda.synchronize()
    return f"{products} bf16 8192^3 products in {seconds:.1f} s ({products * 2 * 8192**3 / seconds / 1e12:.0f} TFLOP/s)"


def gpm_metrics(handle: Any, load_s: float) -> None:
    support = pynvml.nvmlGpmQueryDeviceSupport(handle)
    print(f"GPM supported: {bool(support.isSupportedDevice)}")
    if not support.isSupportedDevice:
        return
    first, second = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    try:
        result: list[str] = []
        started = threading.Event()
        worker = threading.Thread(target=lambda: result.append(busy_gpu(load_s + 0.5, started)))
        worker.start()
        started.wait()
        time.sleep(0.25)
        pynvml.nvmlGpmSampleGet(handle, first)
        time.sleep(load_s)
        pynvml.nvmlGpmSampleGet(handle, second)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        worker.join()
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1, request.sample2 = first, second
        for i, metric_id in enumerate(GPM_METRICS.values()):
            request.metrics[i].metricId = metric_id
        pynvml.nvmlGpmMetricsGet(request)
        print(
            f"load: {result[0] if result else '?'}; nvml utilization.gpu {util.gpu} %, memory {util.memory} %"
        )
        for i, name in enumerate(GPM_METRICS):
            metric = request.metrics[i]
            status = "ok" if metric.nvmlReturn == 0 else pynvml.nvmlErrorString(metric.nvmlReturn)
            print(f"  gpm {name:22} {metric.value:12.2f}  ({status})")
    finally:
        pynvml.nvmlGpmSampleFree(first)
        pynvml.nvmlGpmSampleFree(second)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--load-s", type=float, default=2.0)
    args = parser.parse_args()
    probe_backend()
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        try:
            gpm_metrics(handle, args.load_s)
        except pynvml.NVMLError as exc:
            print(f"GPM: {exc!r}")
    finally:
        pynvml.nvmlShutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
