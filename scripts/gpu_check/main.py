"""Every check a CPU machine cannot run, on this machine's NVIDIA GPUs (scripts/gpu_check.sh).

One line per check: ``ok``, ``n/s`` (not supported on this GPU or driver: what
the agent would count and leave out), or ``FAIL`` with the error. Exit 1 when a
check failed, 0 otherwise, and 0 with one line on a machine without a GPU.

1. the real NVML backend: every GpuSample field, its query errors, GPM
   profiling metrics, throttle violation counters, NVLink, topology calls and
   the XID event thread;
2. a real agent's /metrics against ``nvidia-smi --query-gpu``;
3. the training hook's CUDA-event collective timing with NCCL under torchrun,
   world size 1 (and 2 where two GPUs are), through a real agent and
   coordinator.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "worker.py"
GPM_FIELDS = (
    "graphics_active_ratio",
    "sm_active_ratio",
    "sm_occupancy_ratio",
    "tensor_active_ratio",
    "dram_active_ratio",
)
SMI_FIELDS = ("index", "memory.total", "memory.used", "temperature.gpu", "power.draw")
MIB = 1 << 20
FAILURES: list[str] = []


def say(status: str, name: str, detail: str) -> None:
    if status == "FAIL":
        FAILURES.append(name)
    print(f"{status:<5} {name}: {detail}", flush=True)


def check(name: str, run: Callable[[], None]) -> None:
    """Run one check; an exception is its failure, with the error, and the next check runs."""
    try:
        run()
    except Exception as exc:
        say("FAIL", name, f"{type(exc).__name__}: {exc}")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception as exc:
        print(f"no NVIDIA GPU here ({type(exc).__name__}: {exc}): nothing to check")
        return 0
    if count == 0:
        print("NVML loads but sees no GPU: nothing to check")
        return 0
    print(f"{count} GPU(s), driver {driver_version()}")
    check("nvml backend", nvml_backend)
    check("agent /metrics vs nvidia-smi", agent_against_nvidia_smi)
    for world_size in (1, 2) if count >= 2 else (1,):
        check(
            f"hook CUDA-event timing, NCCL, world size {world_size}",
            functools.partial(hook_with_nccl, world_size),
        )
    return 1 if FAILURES else 0


def driver_version() -> str:
    import pynvml

    pynvml.nvmlInit()
    try:
        return str(pynvml.nvmlSystemGetDriverVersion())
    finally:
        pynvml.nvmlShutdown()


def nvml_backend() -> None:
    from clusterwatch.agent.gpu.nvml_backend import NvmlBackend
    from clusterwatch.v1 import node_pb2

    backend = NvmlBackend()
    try:
        keep_gpu_busy(0.2)  # CUDA set up before the first sample, so that the interval is all load
        backend.sample()
        busy = keep_gpu_busy(1.0)
        samples = backend.sample()
        fields = [f.name for f in node_pb2.GpuSample.DESCRIPTOR.fields]
        for sample in samples:
            present = [f for f in fields if _has(sample, f)]
            say(
                "ok", f"nvml GPU {sample.index}", f"{sample.name}: {len(present)} of {len(fields)} fields set"
            )
            gpm = {f: getattr(sample, f) for f in GPM_FIELDS if _has(sample, f)}
            if gpm:
                # Under a matrix-product loop SM activity is near 1; 0 would be a misread counter.
                idle = busy and sample.index == 0 and gpm["sm_active_ratio"] < 0.5
                status = "FAIL" if idle else "ok"
                say(status, f"gpm GPU {sample.index}", ", ".join(f"{k} {v:.2f}" for k, v in gpm.items()))
            else:
                say(
                    "n/s", f"gpm GPU {sample.index}", "no GPM metric (before Hopper, or see the query errors)"
                )
            violations = {v.reason: round(v.seconds_total, 1) for v in sample.throttle_violations}
            say("ok" if violations else "n/s", f"violations GPU {sample.index}", json.dumps(violations))
            say(
                "ok" if sample.nvlinks else "n/s",
                f"nvlink GPU {sample.index}",
                f"{len(sample.nvlinks)} links",
            )
        for error in backend.query_errors():
            say("n/s", "nvml query", f"{error.function}: {error.error} x{error.count}")
        topology = backend.topology()
        say("ok", "topology", f"{len(topology.gpus)} GPUs, {len(topology.links)} GPU pairs linked")
        for problem in topology.problems:
            say("n/s", "topology", problem)
        say(
            "ok" if backend.xid_thread_running else "FAIL",
            "xid events",
            "the XID thread waits on its event set",
        )
    finally:
        backend.close()


def keep_gpu_busy(seconds: float) -> bool:
    """bf16 matrix products on GPU 0 for ``seconds``, so that GPM has activity to read; a
    plain wait where torch has no CUDA. True when the GPU was kept busy."""
    try:
        import torch
    except ImportError:
        time.sleep(seconds)
        return False
    if not torch.cuda.is_available():
        time.sleep(seconds)
        return False
    matrix = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(8):
            matrix = torch.tanh(matrix @ matrix)
        torch.cuda.synchronize()
    return True


def _has(sample: Any, field: str) -> bool:
    """Whether a GpuSample field carries a value: repeated non-empty, optional set, string non-empty."""
    descriptor = sample.DESCRIPTOR.fields_by_name[field]
    value = getattr(sample, field)
    if descriptor.is_repeated:
        return len(value) > 0
    if descriptor.has_presence:
        return bool(sample.HasField(field))
    return value != "" if isinstance(value, str) else True


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "clusterwatch", *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT
        )


def stop(*processes: subprocess.Popen[bytes]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()


def scrape(url: str, deadline_s: float, wanted: str) -> str:
    end = time.monotonic() + deadline_s
    last = ""
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback URL
                last = str(response.read().decode())
            if wanted in last:
                return last
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} had no {wanted} within {deadline_s:g} s")


def samples(page: str, name: str) -> dict[str, float]:
    """``{gpu index: value}`` of one per-GPU family (first sample per GPU)."""
    found: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            gpu = next(p.split("=")[1].strip('"') for p in labels.split(",") if p.startswith("gpu="))
            found.setdefault(gpu, float(value))
    return found


def agent_against_nvidia_smi() -> None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        say("n/s", "agent /metrics vs nvidia-smi", "no nvidia-smi on PATH")
        return
    # nvidia-smi is read before the agent starts and after its page: the agent's reading lies
    # between the two in time, so in value too (power falls for seconds after a load ends).
    before = smi_reading(smi)
    with tempfile.TemporaryDirectory() as workdir:
        port = free_port()
        agent = start(
            ["agent", "--insecure", "--coordinator", f"127.0.0.1:{free_port()}", "--node-id", "gpucheck",
             "--gpu-backend", "nvml", "--socket", "", "--interval-s", "1", "--metrics-listen", f"127.0.0.1:{port}"],
            Path(workdir) / "agent.log",
        )  # fmt: skip
        try:
            page = scrape(f"http://127.0.0.1:{port}/metrics", 60, "clusterwatch_gpu_temperature_celsius{")
        finally:
            stop(agent)
    after = smi_reading(smi)
    tolerances = {"memory.total": MIB, "memory.used": 64 * MIB, "temperature.gpu": 3.0, "power.draw": 30.0}
    ours = {"memory.total": "memory_total_bytes", "memory.used": "memory_used_bytes",
            "temperature.gpu": "temperature_celsius", "power.draw": "power_watts"}  # fmt: skip
    for index, first in before.items():
        for field, family in ours.items():
            name = f"/metrics GPU {index} {field}"
            mine = samples(page, f"clusterwatch_gpu_{family}").get(index)
            span = [r for r in (first[field], after.get(index, {}).get(field)) if r is not None]
            if not span:
                say("n/s", name, "nvidia-smi says N/A")
            elif mine is None:
                say("FAIL", name, f"missing from the agent's /metrics (nvidia-smi: {span[0]:g})")
            else:
                low, high = min(span) - tolerances[field], max(span) + tolerances[field]
                status = "ok" if low <= mine <= high else "FAIL"
                theirs = " then ".join(f"{r:g}" for r in span)
                say(status, name, f"agent {mine:g}, nvidia-smi {theirs} (tolerance {tolerances[field]:g})")


def smi_reading(smi: str) -> dict[str, dict[str, float | None]]:
    """``{gpu index: {SMI field: value in the agent's units}}`` (MiB as bytes; None for N/A)."""
    rows = subprocess.run(
        [smi, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    reading: dict[str, dict[str, float | None]] = {}
    for row in rows.strip().splitlines():
        index, *values = (v.strip() for v in row.split(","))
        fields = dict(zip(SMI_FIELDS[1:], (_number(v) for v in values), strict=True))
        for field in ("memory.total", "memory.used"):
            value = fields[field]
            fields[field] = None if value is None else value * MIB
        reading[index] = fields
    return reading


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def hook_with_nccl(world_size: int) -> None:
    try:
        import torch
    except ImportError:
        say("n/s", "hook", "torch is not installed")
        return
    if not torch.cuda.is_available():
        say("n/s", "hook", "torch sees no CUDA device (a CPU build of torch?)")
        return
    with tempfile.TemporaryDirectory() as workdir:
        folder = Path(workdir)
        grpc_port, metrics_port, hook_socket = free_port(), free_port(), folder / "agent.sock"
        coordinator = start(
            ["coordinator", "--insecure", "--listen", f"127.0.0.1:{grpc_port}",
             "--metrics-listen", f"127.0.0.1:{metrics_port}", "--state-dir", str(folder / "state")],
            folder / "coordinator.log",
        )  # fmt: skip
        agent = start(
            ["agent", "--insecure", "--coordinator", f"127.0.0.1:{grpc_port}", "--node-id", "gpucheck",
             "--gpu-backend", "nvml", "--socket", str(hook_socket), "--interval-s", "0.5"],
            folder / "agent.log",
        )  # fmt: skip
        try:
            scrape(f"http://127.0.0.1:{metrics_port}/metrics", 60, 'clusterwatch_node_up{node="gpucheck"} 1')
            env = {
                **os.environ,
                "CLUSTERWATCH_AGENT_SOCKET": str(hook_socket),
                "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
            }
            job = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
                 str(WORKER)],
                capture_output=True, text=True, timeout=300, env=env, check=False,
            )  # fmt: skip
            if job.returncode != 0:
                raise RuntimeError(f"torchrun exited {job.returncode}: {job.stderr[-2000:]}")
            page = scrape(
                f"http://127.0.0.1:{metrics_port}/metrics",
                60,
                'clusterwatch_collective_duration_seconds_count{training_job="gpucheck"',
            )
        finally:
            stop(agent, coordinator)
    counts = [
        line
        for line in page.splitlines()
        if line.startswith("clusterwatch_collectives_total{") and "gpucheck" in line
    ]
    durations = [
        line for line in page.splitlines()
        if line.startswith("clusterwatch_collective_duration_seconds_sum{") and "gpucheck" in line
    ]  # fmt: skip
    total = sum(float(line.rsplit(" ", 1)[1]) for line in counts)
    seconds = sum(float(line.rsplit(" ", 1)[1]) for line in durations)
    if total <= 0 or seconds <= 0:
        raise RuntimeError(f"no collective timing reached the coordinator: {counts} {durations}")
    errors = [line for line in page.splitlines() if line.startswith("clusterwatch_rank_hook_errors_total{")]
    hook_errors = sum(float(line.rsplit(" ", 1)[1]) for line in errors)
    say(
        "ok" if hook_errors == 0 else "FAIL",
        f"hook NCCL world size {world_size}",
        f"{total:g} collectives timed, {seconds:.4f} s in all, hook errors {hook_errors:g}",
    )


if __name__ == "__main__":
    sys.exit(main())
