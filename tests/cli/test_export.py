"""``clusterwatch export dashboards|rules DIR`` writes the bundled files (from the wheel:
tests/repo/test_wheel.py; here from the checkout, as an editable install finds them)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers import ROOT, clusterwatch_cmd

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("kind", "folder", "pattern"),
    [("dashboards", "dashboards", "*.json"), ("rules", "deploy/prometheus/rules", "*.yml")],
)
def test_export_writes_every_bundled_file_and_names_it(
    tmp_path: Path, kind: str, folder: str, pattern: str
) -> None:
    stale = tmp_path / "out" / sorted((ROOT / folder).glob(pattern))[0].name
    stale.parent.mkdir()
    stale.write_text("an older version")
    result = subprocess.run(
        clusterwatch_cmd("export", kind, str(tmp_path / "out")), capture_output=True, text=True, check=True
    )
    expected = {p.name: p.read_bytes() for p in (ROOT / folder).glob(pattern)}
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == expected  # replaced, too
    assert sorted(result.stdout.split()) == sorted(str(tmp_path / "out" / name) for name in expected)


def test_export_into_a_file_says_so_and_exits_2(tmp_path: Path) -> None:
    target = tmp_path / "a-file"
    target.write_text("keep me")
    result = subprocess.run(
        clusterwatch_cmd("export", "rules", str(target)), capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"clusterwatch export: {target} is not a directory"
    assert target.read_text() == "keep me"
