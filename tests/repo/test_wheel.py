"""The built wheel installs into fresh virtualenvs: with every extra, every module imports from it;
without extras (a training image's install) only grpcio and protobuf come, and a hooked torchrun
job still reports to a real agent."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from helpers import HOOK_WORKERS, ROOT, Cluster, ranks_of, start_node, wait_for

from clusterwatch.cli import OPTIONAL_MODULES, PROCESS_EXTRAS

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

TRAIN = HOOK_WORKERS / "train_ddp.py"

# The framework callbacks need their framework (an extra), and the reducer's process group
# needs torch (it subclasses torch's ProcessGroup); every other module, the hook's
# included, imports without torch.
IMPORT_EVERYTHING = """
import importlib, pkgutil, sys, clusterwatch
EXTRAS = {"clusterwatch.hook.lightning": {"lightning", "pytorch_lightning"},
          "clusterwatch.hook.transformers": {"transformers"},
          "clusterwatch.hook.collectives.ddp_group": {"torch"}}  # imported once DDP is watched
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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of the files git knows (tracked, or new and not ignored), as a clean clone builds it.

    Built from a copy: setuptools reuses ``build/`` and would pack modules
    left there by an older build of this checkout.
    """
    source = tmp_path_factory.mktemp("source")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(source),
        ],
        check=True,
        cwd=dist,
    )
    (built,) = dist.glob("clusterwatch-*.whl")
    return built


def test_wheel_installs_in_a_fresh_venv_and_imports_every_module(tmp_path: Path, wheel: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", f"{wheel}[all]"], check=True, cwd=tmp_path)
    result = subprocess.run(
        [python, "-c", IMPORT_EVERYTHING], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    location, count, *names = result.stdout.splitlines()
    assert location.startswith(str(env_dir)), location  # from the wheel, not this checkout
    expected = {
        "clusterwatch.cli",
        "clusterwatch.v1.agent_pb2",
        "clusterwatch.agent.runtime",
        "clusterwatch.agent.collectors.gpu",
        "clusterwatch.agent.gpu.nvml_backend",
        "clusterwatch.coordinator.server",
        "clusterwatch.tui",
    }
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
    # A pip-only install has the dashboards and alert rules, byte for byte the repository's.
    for kind, folder, pattern in (
        ("dashboards", "dashboards", "*.json"),
        ("rules", "deploy/prometheus/rules", "*.yml"),
    ):
        exported = tmp_path / kind
        subprocess.run(
            [env_dir / "bin" / "clusterwatch", "export", kind, exported], check=True, capture_output=True
        )
        expected_files = {p.name: p.read_bytes() for p in (ROOT / folder).glob(pattern)}
        assert expected_files
        assert {p.name: p.read_bytes() for p in exported.iterdir()} == expected_files
    version = subprocess.run(
        [env_dir / "bin" / "clusterwatch", "--version"], capture_output=True, text=True, check=True
    )
    assert (
        version.stdout.strip()
        == f"clusterwatch {tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['version']}"
    )
    with zipfile.ZipFile(wheel) as archive:
        (license_file,) = [n for n in archive.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        assert archive.read(license_file) == (ROOT / "LICENSE").read_bytes()
        wheel_metadata = archive.read(license_file.replace("licenses/LICENSE", "METADATA")).decode()
    assert "License-Expression: Apache-2.0" in wheel_metadata
    assert "Project-URL: Source, " in wheel_metadata


def stand_in_torch(where: Path, version: str) -> Path:
    """A wheel named torch ``version`` with one empty module: what pip resolves against."""
    path = where / f"torch-{version.replace('+', '_')}-py3-none-any.whl"
    info = f"torch-{version}.dist-info"
    files = {
        "torch/__init__.py": "",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: clusterwatch-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"]))
    return path


def metadata_version(python: Path, distribution: str) -> str:
    code = f"from importlib.metadata import version; print(version({distribution!r}))"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_the_hook_extras_ask_for_a_torch_and_never_pin_one() -> None:
    """Pinned, an extra would replace the CUDA torch of a training image (./dev pins this machine's)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in ("torch", "lightning", "transformers"):
        (torch,) = [r for r in extras[name] if _requirement_names([r]) == {"torch"}]
        assert re.fullmatch(r"torch>=[0-9.]+", torch), torch


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] != "clusterwatch":
        parts.insert(0, "clusterwatch")
    return ".".join(parts)


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def _requirement_names(requirements: list[str]) -> set[str]:
    return {_normalized(re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0]) for r in requirements}


def test_every_optional_module_comes_with_an_extra_and_not_with_the_hook() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = _requirement_names(project["dependencies"])
    extras = {name: _requirement_names(reqs) for name, reqs in project["optional-dependencies"].items()}
    assert extras.keys() >= PROCESS_EXTRAS
    assert extras["all"] == {"clusterwatch"}  # clusterwatch[agent,coordinator,top]
    in_process_extras = set().union(*(extras[name] for name in PROCESS_EXTRAS))
    distributions = metadata.packages_distributions()
    for module in OPTIONAL_MODULES:
        (distribution,) = {_normalized(d) for d in distributions[module]}
        assert distribution in in_process_extras, module
        assert distribution not in base, module
    assert base == {"grpcio", "protobuf"}  # the training hook's install


def test_the_hook_alone_installs_without_the_daemons_dependencies_and_reports(
    tmp_path: Path, wheel: Path, cluster: Cluster
) -> None:
    env_dir = tmp_path / "slim"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    pip = [python, "-m", "pip", "install", "-q"]
    # An image whose torch is some other build (a stand-in distribution: pip reads only its
    # name and version): the hook's extra must leave it in place.
    subprocess.run([*pip, str(stand_in_torch(tmp_path, "2.4.1+cu121"))], check=True, cwd=tmp_path)
    subprocess.run([*pip, str(wheel)], check=True, cwd=tmp_path)
    plan = subprocess.run(
        [*pip, "--no-index", "--dry-run", "--report", "-", f"{wheel}[torch]"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    )  # fmt: skip
    assert [item["metadata"]["name"] for item in json.loads(plan.stdout)["install"]] == []
    subprocess.run([*pip, "torch==2.13.0"], check=True, cwd=tmp_path)  # the image's own torch
    own_torch = metadata_version(python, "torch")
    subprocess.run([*pip, f"{wheel}[torch]"], check=True, cwd=tmp_path)
    assert metadata_version(python, "torch") == own_torch
    installed = subprocess.run(
        [python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True
    ).stdout
    names = {package["name"].lower() for package in json.loads(installed)}
    for absent in ("textual", "cryptography", "py-spy", "psutil", "nvidia-ml-py", "prometheus-client"):
        assert absent not in names
    missing = subprocess.run(
        [env_dir / "bin" / "clusterwatch", "agent", "--insecure", "--coordinator", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert missing.returncode == 1
    assert "pip install 'clusterwatch[agent]'" in missing.stderr

    coordinator, socket = start_node(cluster)  # from this checkout's environment
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CLUSTERWATCH_AGENT_SOCKET": str(socket)}
    env.pop("PYTHONPATH", None)
    job = subprocess.run(
        [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(TRAIN),
            "--out-dir",
            str(out),
            "--job",
            "slim",
            "--steps",
            "30",
            "--compute-ms",
            "20",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((out / f"rank{rank}.json").read_text())
        assert result["clusterwatch_dir"].startswith(str(env_dir))  # the slim install's hook
        assert result["connected"]
        assert result["hook_errors_total"] == 0
    wait_for(lambda: len(ranks_of(coordinator, "slim")) == 2 or None, 30, "both ranks at the coordinator")
