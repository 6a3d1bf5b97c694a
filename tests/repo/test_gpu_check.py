"""scripts/gpu_check.sh, the one command for a GPU machine: without a GPU it says so and exits 0;
its NVML checks run here against the fake NVML, so a GPU session does not find it broken."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from fakes.fake_pynvml import FakeNvml, h100
from helpers import ROOT

from clusterwatch.agent.gpu import nvml_backend
from clusterwatch.exposition.node_metrics import register_node_families, write_node
from clusterwatch.exposition.promtext import Exposition
from clusterwatch.v1 import node_pb2

pytestmark = pytest.mark.timeout(120)


def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gpu_check_main", ROOT / "scripts" / "gpu_check" / "main.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_says_so_and_exits_0() -> None:
    result = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh")],
        capture_output=True, text=True, check=False, timeout=60, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    assert line.startswith("no NVIDIA GPU here")


def test_the_nvml_checks_report_every_gpu_against_the_fake(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeNvml([h100(0), h100(1)])
    fake.devices[1].gpm_percent = None  # an older GPU beside a Hopper
    real = nvml_backend.NvmlBackend
    monkeypatch.setattr(nvml_backend, "NvmlBackend", lambda: real(fake, xid_wait_timeout_ms=50))
    module = gpu_check()
    module.nvml_backend()
    lines = capsys.readouterr().out.splitlines()
    assert not [line for line in lines if line.startswith("FAIL")], lines
    assert any(line.startswith("ok    gpm GPU 0: graphics_active_ratio 0.96") for line in lines), lines
    assert "n/s   gpm GPU 1: no GPM metric (before Hopper, or see the query errors)" in lines
    assert "n/s   nvml query: nvmlGpmQueryDeviceSupport: NotSupported x1" in lines
    assert "ok    nvlink GPU 0: 18 links" in lines
    assert any(line.startswith("ok    topology: 2 GPUs") for line in lines), lines
    assert "ok    xid events: the XID thread waits on its event set" in lines
    assert module.FAILURES == []


def test_it_reads_the_agents_page_per_gpu() -> None:
    report = node_pb2.NodeReport()
    for index, temperature in ((0, 61.0), (1, 67.5)):
        report.gpus.add(index=index, uuid=f"GPU-{index}", temperature_celsius=temperature)
    exp = Exposition()
    register_node_families(exp)
    write_node(exp, "n1", report)
    page = exp.render().decode()
    assert gpu_check().samples(page, "clusterwatch_gpu_temperature_celsius") == {"0": 61.0, "1": 67.5}


def test_the_script_is_executable() -> None:
    assert (ROOT / "scripts" / "gpu_check.sh").stat().st_mode & 0o111
    assert Path(ROOT / "scripts" / "gpu_check" / "worker.py").is_file()
