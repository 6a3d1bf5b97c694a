"""A port that is taken stops the process with one line naming the setting and the port, exit 1:
never a second coordinator sharing the first one's gRPC port (SO_REUSEPORT), never a traceback."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import Cluster, Coordinator, clusterwatch_cmd

pytestmark = pytest.mark.timeout(120)


def start(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        clusterwatch_cmd(*args), capture_output=True, text=True, check=False, timeout=60, cwd=tmp_path
    )


def ours(stderr: str) -> list[str]:
    """Our own lines (gRPC's C core may log its bind failure too, prefixed E<date>)."""
    return [
        line
        for line in stderr.splitlines()
        if line.startswith("clusterwatch ") or "Traceback" in line or "Error" in line.split(":")[0]
    ]


def coordinator_on(tmp_path: Path, *listen: str) -> subprocess.CompletedProcess[str]:
    return start(
        tmp_path, "coordinator", "--insecure", "--state-dir", str(tmp_path / "second"),
        "--listen", "127.0.0.1:0", "--metrics-listen", "", *listen,
    )  # fmt: skip


@pytest.fixture
def first(cluster: Cluster) -> Coordinator:
    return cluster.coordinator("--api-listen", "127.0.0.1:0")


def test_a_second_coordinator_on_a_taken_grpc_port_refuses_to_start(
    first: Coordinator, tmp_path: Path
) -> None:
    result = coordinator_on(tmp_path, "--listen", first.address)
    assert result.returncode == 1
    assert ours(result.stderr) == [
        f"clusterwatch coordinator: coordinator.listen: cannot listen on {first.address}: port "
        f"{first.grpc_port} is taken (another coordinator or agent, or another program, listens there)"
    ]


@pytest.mark.parametrize("setting", ["metrics-listen", "api-listen"])
def test_a_taken_metrics_or_api_port_is_one_line(first: Coordinator, tmp_path: Path, setting: str) -> None:
    port = (
        first.metrics_port
        if setting == "metrics-listen"
        else json.loads(first.ready_file.read_text())["api_port"]
    )
    result = coordinator_on(tmp_path, f"--{setting}", f"127.0.0.1:{port}")
    assert result.returncode == 1
    assert ours(result.stderr) == [
        f"clusterwatch coordinator: coordinator.{setting.replace('-', '_')}: cannot "
        f"{'serve /metrics' if setting == 'metrics-listen' else 'listen'} on 127.0.0.1:{port}: port {port} "
        "is taken (another coordinator or agent, or another program, listens there)"
    ]


def test_an_agent_on_a_taken_metrics_port_says_so(first: Coordinator, tmp_path: Path) -> None:
    result = start(
        tmp_path, "agent", "--insecure", "--coordinator", first.address, "--gpu-backend", "none", "--socket", "",
        "--metrics-listen", f"127.0.0.1:{first.metrics_port}",
    )  # fmt: skip
    assert result.returncode == 1
    assert ours(result.stderr) == [
        f"clusterwatch agent: agent.metrics_listen: cannot serve /metrics on 127.0.0.1:{first.metrics_port}: "
        f"port {first.metrics_port} is taken (another coordinator or agent, or another program, listens there)"
    ]
