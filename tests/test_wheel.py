"""The built wheel installs into a fresh virtualenv and every module imports from it."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent

# The framework callbacks need their framework (an extra); every other module,
# the hook's included, imports without torch.
IMPORT_EVERYTHING = """
import importlib, pkgutil, sys, clusterwatch
EXTRAS = {"clusterwatch.hook.lightning": {"lightning", "pytorch_lightning"},
          "clusterwatch.hook.transformers": {"transformers"}}
names = [m.name for m in pkgutil.walk_packages(clusterwatch.__path__, "clusterwatch.")
         if m.name != "clusterwatch.__main__"]  # importing it runs the CLI
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name not in EXTRAS.get(name, ()):
            raise
print(clusterwatch.__file__)
print(len(names))
print("\\n".join(names))
"""


def test_wheel_installs_in_a_fresh_venv_and_imports_every_module(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(ROOT)],
        check=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = dist.glob("clusterwatch-*.whl")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", str(wheel)], check=True, cwd=tmp_path)
    result = subprocess.run(
        [python, "-c", IMPORT_EVERYTHING], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    location, count, *names = result.stdout.splitlines()
    assert location.startswith(str(env_dir)), location  # from the wheel, not this checkout
    expected = {
        "clusterwatch.cli", "clusterwatch.v1.agent_pb2", "clusterwatch.agent.runtime",
        "clusterwatch.agent.collectors.gpu", "clusterwatch.agent.gpu.nvml_backend",
        "clusterwatch.coordinator.server", "clusterwatch.tui",
    }  # fmt: skip
    assert expected <= set(names)
    # Every source module of the repository is in the wheel.
    in_repo = {
        _module_name(p)
        for d in ("clusterwatch", "agent", "coordinator", "tui")  # clusterwatch/hook is inside clusterwatch/
        for p in (ROOT / d).rglob("*.py")
    }
    assert {m for m in in_repo if not m.endswith(".__init__")} - {"clusterwatch.__main__"} <= set(names)
    assert int(count) == len(names)
    no_generic = subprocess.run(
        [python, "-c", "import agent"], capture_output=True, cwd=tmp_path, check=False
    )
    assert no_generic.returncode != 0  # no top-level `agent` package is installed
    cli = subprocess.run(
        [env_dir / "bin" / "clusterwatch", "--help"], capture_output=True, text=True, check=True
    )
    assert "coordinator" in cli.stdout


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] != "clusterwatch":
        parts.insert(0, "clusterwatch")
    return ".".join(parts)
