"""Whatever command reads the config file, a misspelt section or key in it stops that command with
one line naming it (and the nearest known name), exit 2: never silently ignored. And output cut
short by its reader (``clusterwatch status | head``) ends quietly."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers import clusterwatch_cmd

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[agnet]\ninterval_s = 2\n", "agnet: unknown section [agnet] (did you mean agent?)"),
        ("[agent]\nintervall_s = 2\n", "agent.intervall_s: unknown setting (did you mean interval_s?)"),
        (
            "[client]\ntimeout_s = 3\n[detecton]\n",
            "detecton: unknown section [detecton] (did you mean detection?)",
        ),
        ("[recovery]\nzzz = 1\n", "recovery.zzz: unknown setting (known: "),
    ],
)
@pytest.mark.parametrize("command", [["status"], ["agent", "--gpu-backend", "none"], ["export", "rules"]])
def test_a_misspelt_name_anywhere_in_the_file_stops_every_command(
    tmp_path: Path, text: str, expected: str, command: list[str]
) -> None:
    path = tmp_path / "clusterwatch.toml"
    path.write_text(text)
    args = [*command, str(tmp_path / "out")] if command[0] == "export" else command
    result = subprocess.run(
        clusterwatch_cmd(*args, "--config", str(path)),
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    if command[0] == "export":  # reads no settings: the file does not concern it
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode == 2
    (line,) = [line for line in result.stderr.splitlines() if "WARNING" not in line]
    assert line.startswith(f"clusterwatch: invalid configuration: {expected}")
    assert line.endswith(f"(from {path})")


def test_output_cut_short_by_its_reader_ends_quietly(tmp_path: Path) -> None:
    """stdout is a pipe whose reader has gone: the first write fails with EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            clusterwatch_cmd("export", "dashboards", str(tmp_path / "out")),
            stdout=write_end, stderr=subprocess.PIPE, text=True, check=False, timeout=30,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == 141  # 128 + SIGPIPE, as a program SIGPIPE killed
