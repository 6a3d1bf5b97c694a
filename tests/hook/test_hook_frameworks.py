"""The Lightning and Hugging Face callbacks, in real 2-process jobs on CPU (gloo) under torchrun:
added by the script, or by `clusterwatch run` to a script that knows nothing of clusterwatch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import (
    HOOK_WORKERS,
    Cluster,
    checkpoint_and_wait,
    ranks_of,
    start_node,
    stop_framework_job,
    wait_for_ranks_past,
)

WORKERS = HOOK_WORKERS

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_lightning_ddp_steps_and_buckets_reach_the_coordinator(cluster: Cluster, tmp_path: Path) -> None:
    coordinator, socket = start_node(cluster)
    out = tmp_path / "out"
    until = tmp_path / "stop"
    job = cluster.torchrun(
        WORKERS / "train_lightning.py",
        "--out-dir",
        str(out),
        "--max-steps",
        "100000",
        "--until-file",
        str(until),
        nproc=2,
        socket=socket,
    )

    wait_for_ranks_past(coordinator, "lightning-job", 2, step=5, timeout_s=180)
    ranks = ranks_of(coordinator, "lightning-job")
    for status in ranks.values():
        assert status.identity.world_size == 2
        assert status.identity.backend == "gloo"
        assert "ddp_all_reduce" in {b.op for b in status.bandwidth}

    # A checkpoint on request goes through trainer.save_checkpoint on both ranks.
    target = checkpoint_and_wait(coordinator, "lightning-job", 90)
    assert (out / "checkpoints" / f"clusterwatch-step={target}.ckpt").exists()
    stop_framework_job(coordinator, "lightning-job", until)
    assert job.wait(120) == 0, job.log()
    assert all(json.loads((out / f"rank{r}.json").read_text())["global_step"] > 5 for r in range(2))


def test_hugging_face_trainer_steps_and_checkpoints(cluster: Cluster, tmp_path: Path) -> None:
    coordinator, socket = start_node(cluster)
    out = tmp_path / "out"
    until = tmp_path / "stop"
    job = cluster.torchrun(
        WORKERS / "train_hf.py",
        "--out-dir",
        str(out),
        "--max-steps",
        "100000",
        "--until-file",
        str(until),
        nproc=2,
        socket=socket,
    )

    wait_for_ranks_past(coordinator, "hf-job", 2, step=3, timeout_s=180)
    target = checkpoint_and_wait(coordinator, "hf-job", 90)
    # The Trainer saved it its own way: checkpoint-{global_step} after step `target`.
    assert (out / "hf" / f"checkpoint-{target + 1}" / "trainer_state.json").exists()
    stop_framework_job(coordinator, "hf-job", until)
    assert job.wait(120) == 0, job.log()


def test_an_unmodified_lightning_script_under_run_gets_the_callback(cluster: Cluster, tmp_path: Path) -> None:
    """Lightning's callbacks_factory entry point adds it; steps are the Trainer's global steps."""
    coordinator, socket = start_node(cluster)
    out, until = tmp_path / "out", tmp_path / "stop"
    job = cluster.torchrun(
        WORKERS / "train_lightning.py",
        *("--out-dir", str(out), "--max-steps", "100000", "--until-file", str(until), "--unmodified"),
        nproc=2,
        socket=socket,
        env={"CLUSTERWATCH_JOB": "lightning-run"},
        launcher="clusterwatch.run",
    )
    wait_for_ranks_past(coordinator, "lightning-run", 2, step=5, timeout_s=180)
    target = checkpoint_and_wait(coordinator, "lightning-run", 90)
    # Saved by trainer.save_checkpoint, where the callback puts it by default.
    assert (out / "clusterwatch" / f"clusterwatch-step={target}.ckpt").exists()
    stop_framework_job(coordinator, "lightning-run", until)
    assert job.wait(120) == 0, job.log()[-4000:]
    global_steps = [json.loads((out / f"rank{r}.json").read_text())["global_step"] for r in range(2)]
    # Steps numbered as the Trainer numbers them (from 0), not by the optimizer-step hook (from 1).
    for rank in ranks_of(coordinator, "lightning-run").values():
        assert rank.last_step.step == global_steps[rank.identity.rank] - 1


def test_an_unmodified_hugging_face_script_under_run_gets_the_callback(
    cluster: Cluster, tmp_path: Path
) -> None:
    """clusterwatch run's import hook adds it to the Trainer; the Trainer saves the checkpoint its own way."""
    coordinator, socket = start_node(cluster)
    out, until = tmp_path / "out", tmp_path / "stop"
    job = cluster.torchrun(
        WORKERS / "train_hf.py",
        *("--out-dir", str(out), "--max-steps", "100000", "--until-file", str(until), "--unmodified"),
        nproc=2,
        socket=socket,
        env={"CLUSTERWATCH_JOB": "hf-run"},
        launcher="clusterwatch.run",
    )
    wait_for_ranks_past(coordinator, "hf-run", 2, step=3, timeout_s=180)
    target = checkpoint_and_wait(coordinator, "hf-run", 90)
    assert (out / "hf" / f"checkpoint-{target + 1}" / "trainer_state.json").exists()
    stop_framework_job(coordinator, "hf-run", until)
    assert job.wait(120) == 0, job.log()[-4000:]
    global_steps = [json.loads((out / f"rank{r}.json").read_text())["global_step"] for r in range(2)]
    for rank in ranks_of(coordinator, "hf-run").values():
        assert rank.last_step.step == global_steps[rank.identity.rank] - 1
