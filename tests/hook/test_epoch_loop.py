"""The epoch x DataLoader loop of docs/hook.md, run as written (issue 23, item 7): steps count batches
across epochs, each epoch ends with a checkpoint of its own, and a restarted job resumes at the next
epoch from the newest checkpoint every rank completed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import HOOK_WORKERS, Cluster, latest_complete_checkpoint, ranks_of, start_node, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

EPOCH_LOOP = HOOK_WORKERS / "epoch_loop.py"
STEPS_PER_EPOCH = 64 // 8  # each rank's share of the data set over the batch size


def test_an_epoch_loop_checkpoints_every_epoch_and_resumes_at_the_next(
    cluster: Cluster, tmp_path: Path
) -> None:
    coordinator, socket = start_node(cluster)
    out = tmp_path / "out"

    def run(epochs: int) -> list[dict[str, int]]:
        job = cluster.torchrun(
            EPOCH_LOOP,
            *("--epochs", str(epochs), "--out-dir", str(out)),
            nproc=2,
            socket=socket,
            env={"CLUSTERWATCH_JOB": "epochs"},
        )
        assert job.wait(180) == 0, job.log()[-4000:]
        last = epochs * STEPS_PER_EPOCH - 1
        wait_for(
            lambda: latest_complete_checkpoint(coordinator, "epochs") == last,
            60,
            f"the checkpoint of epoch {epochs - 1} (step {last}) complete on every rank",
        )
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]

    assert run(2) == [{"start_step": 0, "start_epoch": 0, "end_step": 16}] * 2
    assert run(3) == [{"start_step": 16, "start_epoch": 2, "end_step": 24}] * 2
    assert all(rank.last_step.step == 23 for rank in ranks_of(coordinator, "epochs").values())
