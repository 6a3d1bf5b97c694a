"""The repository's layout rules that no tool checks by itself: the wheel's package list and the layer bans."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = pytest.mark.timeout(30)

# Top-level folders that import as clusterwatch.* (clusterwatch/ itself, and the components).
COMPONENTS = {
    "clusterwatch": "clusterwatch",
    "agent": "clusterwatch.agent",
    "coordinator": "clusterwatch.coordinator",
    "tui": "clusterwatch.tui",
}


def _setuptools() -> dict[str, object]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        section: dict[str, object] = tomllib.load(f)["tool"]["setuptools"]
    return section


def _packages_on_disk() -> dict[str, Path]:
    found = {}
    for folder, package in COMPONENTS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found[".".join((package, *rel.parts))] = init.parent
    return found


# Folders of data, not code, shipped as packages (clusterwatch/bundled.py reads them).
DATA_PACKAGES = {"clusterwatch.dashboards": "dashboards", "clusterwatch.rules": "deploy/prometheus/rules"}


def test_pyproject_lists_every_package_so_a_new_folder_cannot_be_left_out_of_the_wheel() -> None:
    listed = _setuptools()["packages"]
    assert isinstance(listed, list)
    assert sorted(set(_packages_on_disk()) - set(listed)) == []
    assert sorted(set(listed) - set(_packages_on_disk()) - DATA_PACKAGES.keys()) == []
    for package, folder in DATA_PACKAGES.items():
        assert package in listed
        assert _setuptools()["package-dir"][package] == folder
        assert not (ROOT / folder / "__init__.py").exists()  # data only: nothing to import


def test_package_dir_maps_every_package_to_its_folder() -> None:
    package_dir = _setuptools()["package-dir"]
    assert isinstance(package_dir, dict)
    for package, folder in _packages_on_disk().items():
        # setuptools' rule: the nearest mapped ancestor's folder, plus the rest of the name.
        parts = package.split(".")
        for cut in range(len(parts), 0, -1):
            if ".".join(parts[:cut]) in package_dir:
                mapped = ROOT / package_dir[".".join(parts[:cut])] / Path(*parts[cut:])
                break
        else:
            mapped = ROOT / Path(*parts)
        assert mapped == folder, package


def test_a_ruff_toml_that_extends_another_keeps_its_bans() -> None:
    """ruff replaces banned-api when a file extends another: a room must repeat its parent's bans."""
    checked = 0
    for path in ROOT.glob("*/**/ruff.toml"):
        if ".venv" in path.parts or "build" in path.parts:
            continue
        config = tomllib.loads(path.read_text())
        parent = (path.parent / config.get("extend", "")).resolve()
        if parent.name != "ruff.toml":
            continue
        bans = config["lint"]["flake8-tidy-imports"]["banned-api"]
        parent_bans = tomllib.loads(parent.read_text())["lint"]["flake8-tidy-imports"]["banned-api"]
        assert sorted(set(parent_bans) - set(bans)) == [], path
        checked += 1
    assert checked >= 1
