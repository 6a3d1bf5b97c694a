"""`clusterwatch run`: an unmodified DDP script under real torchrun on gloo reports its steps (one per
optimizer step) and its DDP buckets, without one line of clusterwatch in it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import HOOK_WORKERS, Cluster, ranks_of, samples_named, scrape, start_node, wait_for

from clusterwatch.cli.run_cmd import BOOTSTRAP, torchrun_argv

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

SCRIPT = HOOK_WORKERS / "plain_ddp.py"


def test_torchruns_options_stay_and_only_the_worker_command_changes() -> None:
    assert torchrun_argv(["--standalone", "--nproc-per-node", "2", "train.py", "--lr", "3"]) == [
        "--standalone", "--nproc-per-node", "2", "-m", BOOTSTRAP, "train.py", "--lr", "3",
    ]  # fmt: skip
    assert torchrun_argv(["--nnodes=1:2", "-m", "pkg.train", "-m", "x"]) == [
        "--nnodes=1:2", "-m", BOOTSTRAP, "--module", "pkg.train", "-m", "x",
    ]  # fmt: skip
    assert torchrun_argv(["--no-python", "echo", "hi"]) == ["--no-python", "echo", "hi"]
    assert torchrun_argv(["--run-path", "/abs/train.py"]) == ["-m", BOOTSTRAP, "/abs/train.py"]


def launch(socket: Path, job: str, *args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "CLUSTERWATCH_AGENT_SOCKET": str(socket),
        "CLUSTERWATCH_JOB": job,
        "OMP_NUM_THREADS": "1",
    }
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [sys.executable, "-m", "clusterwatch", "run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), *args],
        capture_output=True, text=True, check=False, timeout=180, env=env, cwd=tmp_path,
    )  # fmt: skip


def test_an_unmodified_ddp_script_reports_a_step_per_optimizer_step_and_its_buckets(
    cluster: Cluster, tmp_path: Path
) -> None:
    coordinator, socket = start_node(cluster)
    steps, accumulate = 12, 4  # numbered 0..11 as the optimizer steps; 1..11 are timed
    result = launch(
        socket, "plain", "--steps", str(steps), "--accumulate", str(accumulate), tmp_path=tmp_path
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "rank 0 pid" in result.stdout  # the script's own output passes through

    def all_steps() -> bool:
        ranks = ranks_of(coordinator, "plain")
        return len(ranks) == 2 and all(r.last_step.step == steps - 1 for r in ranks.values())

    wait_for(all_steps, 60, "every rank's last optimizer step at the coordinator")
    for rank in ranks_of(coordinator, "plain").values():
        # A step ends at an optimizer step and spans its four micro-batches (5 ms of work each).
        assert rank.last_step.step_seconds >= accumulate * 0.005
    samples = scrape(coordinator.metrics_url)
    buckets = samples_named(
        samples, "clusterwatch_collectives_total", training_job="plain", op="ddp_all_reduce"
    )
    explicit = samples_named(samples, "clusterwatch_collectives_total", training_job="plain", op="all_reduce")
    assert sum(s.value for s in buckets) > 0  # DDP watched without watch()
    assert sum(s.value for s in explicit) > 0


def test_a_script_that_fails_fails_the_run(cluster: Cluster, tmp_path: Path) -> None:
    _, socket = start_node(cluster)
    result = launch(socket, "failing", "--steps", "2", "--exit-code", "3", tmp_path=tmp_path)
    assert result.returncode != 0
    assert "exitcode  : 3" in result.stderr  # torchrun's report names the script's own code
