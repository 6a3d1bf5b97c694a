"""FSDP2, (dp, tp) DTensor and DeepSpeed ZeRO-3 jobs, unmodified, under `clusterwatch run` on gloo: every rank's
communication time is measured (FSDP2's collectives through torch.distributed, DTensor's
functional all-reduces through wait_tensor, DeepSpeed's through torch.distributed) and a rank 30 % slower is named as a compute
straggler (issue 23, item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import HOOK_WORKERS, Cluster, incident_of, incidents, ranks_of, start_node, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SCRIPT = HOOK_WORKERS / "sharded.py"


@pytest.mark.parametrize(("parallel", "nproc"), [("fsdp", 3), ("tp", 4), ("zero3", 3)])
def test_a_slow_rank_of_a_sharded_job_is_a_compute_straggler(
    cluster: Cluster, tmp_path: Path, parallel: str, nproc: int
) -> None:
    coordinator, socket = start_node(cluster)
    until = tmp_path / "stop"
    slow = nproc - 1
    job = cluster.torchrun(
        SCRIPT,
        *("--parallel", parallel, "--compute-ms", "40", "--slow-rank", str(slow), "--until-file", str(until)),
        nproc=nproc,
        socket=socket,
        env={"CLUSTERWATCH_JOB": parallel, "DS_ACCELERATOR": "cpu"},
        launcher="clusterwatch.run",
    )
    try:
        straggler = wait_for(
            lambda: incident_of(coordinator, "straggler", slow), 150, f"a straggler incident for rank {slow}"
        )
        ranks = ranks_of(coordinator, parallel)
    finally:
        until.touch()
    assert list(straggler.ranks) == [slow]
    assert straggler.cause == "compute"
    assert not [i for i in incidents(coordinator) if i.kind == "straggler" and slow not in i.ranks]
    # The fast ranks wait for the slow one inside collectives the hook times.
    for rank, status in ranks.items():
        if rank != slow:
            assert status.last_step.communication_seconds > 0, (rank, status.last_step)
        # And the hook saw (or timed the wait of) every collective the Flight Recorder saw.
        assert not [s for s in status.heartbeat.blind_spots if "were not timed" in s], status.heartbeat
    if parallel == "tp":
        # DTensor's functional all-reduces over the tp group (not the default group "0").
        tp_all_reduces = [
            c for c in ranks[0].collectives if c.op == "all_reduce" and c.group_name != "0" and c.count > 0
        ]
        assert tp_all_reduces, list(ranks[0].collectives)
    assert job.wait(120) == 0, job.log()[-4000:]
