"""A `clusterwatch coordinator` subprocess for a benchmark: started on loopback, waited for until it serves."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

START_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class StartedCoordinator:
    process: subprocess.Popen[bytes]
    grpc_port: int
    metrics_port: int | None
    # ClusterService's own port (coordinator.api_listen), when started with --api-listen.
    api_port: int | None
    # time.monotonic() when its ready file appeared: gRPC (and /metrics) serve from then on.
    ready_at_s: float

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


def start_coordinator(
    state_dir: Path,
    *extra: str,
    port: int = 0,
    metrics: bool = True,
    log_level: str = "warning",
    log: Path | None = None,
    poll_s: float = 0.05,
) -> StartedCoordinator:
    """Start a plaintext coordinator on 127.0.0.1:``port`` (0: any) with its state in ``state_dir``.

    Args:
        extra: more command-line flags (e.g. ``--hang-action alert``).
        metrics: serve /metrics on a free loopback port.
        log: where its output goes (default: this process's stdout and stderr).
        poll_s: how often to look for the ready file (small when the start is timed).

    Raises:
        SystemExit: it exited or did not serve within START_TIMEOUT_S (with its log's tail).
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    ready = state_dir / "coordinator.ready"
    ready.unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "clusterwatch",
        "coordinator",
        "--insecure",
        "--listen",
        f"127.0.0.1:{port}",
        "--metrics-listen",
        "127.0.0.1:0" if metrics else "",
        "--state-dir",
        str(state_dir),
        "--ready-file",
        str(ready),
        "--log-level",
        log_level,
        *extra,
    ]
    if log is None:
        process = subprocess.Popen(argv)
    else:
        with log.open("wb") as output:
            process = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            tail = log.read_text(errors="replace")[-2000:] if log is not None else ""
            raise SystemExit(f"the coordinator did not start (exit code {process.poll()}):\n{tail}")
        time.sleep(poll_s)
    ready_at_s = time.monotonic()
    ports = json.loads(ready.read_text())
    return StartedCoordinator(
        process, ports["grpc_port"], ports["metrics_port"], ports["api_port"], ready_at_s
    )


def stop_coordinator(process: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """SIGTERM, then SIGKILL if it does not exit within ``timeout_s``."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
