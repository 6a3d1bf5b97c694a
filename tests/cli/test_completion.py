"""``clusterwatch completion bash|zsh``: generated from the parser, run in a real bash."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from helpers import run_cli

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def script() -> str:
    result = run_cli("completion", "bash")
    assert result.returncode == 0, result.stderr
    return result.stdout


def complete(script: str, *words: str) -> list[str]:
    """What bash offers after ``words`` (the last one being typed), with the script loaded."""
    quoted = " ".join(f"'{w}'" for w in words)
    probe = f"{script}\nCOMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; _clusterwatch; printf '%s\\n' \"${{COMPREPLY[@]}}\""
    result = subprocess.run(
        ["bash", "--norc", "-c", probe], capture_output=True, text=True, check=True, timeout=30
    )
    return result.stdout.split()


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (("clusterwatch", "sta"), ["status"]),
        (("clusterwatch", "co"), ["coordinator", "completion"]),
        (("clusterwatch", "coordinator", "--hang-action", "r"), ["restart"]),
        (("clusterwatch", "coordinator", "--launcher", ""), ["torchrun", "slurm", "kubernetes"]),
        (("clusterwatch", "agent", "--gpu-backend", ""), ["auto", "nvml", "sim", "none"]),
        (("clusterwatch", "export", ""), None),  # checked below: its kinds and flags
        (("clusterwatch", "status", "--timeout-"), ["--timeout-s"]),
        (("clusterwatch", "certs", "i"), ["init", "issue"]),
    ],
)
def test_bash_completes_commands_flags_and_choices(
    script: str, words: tuple[str, ...], expected: list[str] | None
) -> None:
    offered = complete(script, *words)
    if expected is None:
        assert {"dashboards", "rules", "--help"} <= set(offered)
        return
    assert sorted(offered) == sorted(expected)


def test_old_flag_names_are_not_offered(script: str) -> None:
    assert complete(script, "clusterwatch", "status", "--timeout") == ["--timeout-s"]
    assert "--grpc-port" not in complete(script, "clusterwatch", "demo", "--")


def test_a_flag_that_takes_a_path_completes_file_names(script: str, tmp_path: object) -> None:
    assert "/etc/hostname" in complete(script, "clusterwatch", "status", "--tls-ca", "/etc/hostn")
    assert complete(script, "clusterwatch", "status", "--timeout-s", "/etc/hostn") == []


def test_zsh_loads_the_same_through_bashcompinit(script: str) -> None:
    result = run_cli("completion", "zsh")
    assert result.returncode == 0
    assert "bashcompinit" in result.stdout
    assert result.stdout.endswith(script)
    zsh = shutil.which("zsh")
    if zsh is not None:  # not installed by ./dev: checked where it is
        subprocess.run([zsh, "-n", "-c", result.stdout], check=True, timeout=30)
