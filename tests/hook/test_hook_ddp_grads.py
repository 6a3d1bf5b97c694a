"""A watched CPU DDP model computes what an unwatched one does, with no extra pass: a 3-rank torchrun job.

The job (tests/hook_workers/ddp_grads_worker.py) trains three copies of one
model on the same batches: unwatched, watched (default), and watched with the
comm hook (``CLUSTERWATCH_DDP_TIMING=comm_hook``). Everything compared comes
from the same run: gradients bit for bit, and the ``aten::div_`` calls each
backward ran (the comm hook's second pass over every bucket; issue 18, item 5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from helpers import HOOK_WORKERS

pytestmark = pytest.mark.timeout(120)

WORKER = HOOK_WORKERS / "ddp_grads_worker.py"
Rank = dict[str, Any]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Rank]:
    out_dir = tmp_path_factory.mktemp("ddp_grads")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=3",
        "--max-restarts=0",
        str(WORKER),
        str(out_dir),
    ]
    job = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=100, check=False)
    assert job.returncode == 0, (
        f"worker failed ({job.returncode}):\n{job.stdout[-5000:]}\n{job.stderr[-5000:]}"
    )
    results = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(3)]
    for rank in results:
        assert rank["errors"] == [], rank["errors"]  # the hook's own bookkeeping never failed
    return results


def test_a_watched_cpu_model_has_no_comm_hook_and_its_gradients_are_ddps_own(ranks: list[Rank]) -> None:
    for rank in ranks:
        assert rank["comm_hooks"]["watched"] == 0
        for step in rank["steps"]:
            plain, watched = step["plain"], step["watched"]
            assert watched["identical"], watched  # bit for bit, bucket rebuild included
            # No second pass over the buckets: the same divisions as the unwatched model.
            assert watched["div_calls"] == plain["div_calls"]
            # ... and every bucket timed, with what it carried.
            assert watched["buckets"] >= 1
            assert watched["bucket_bytes"] == rank["param_bytes"]
            assert plain["buckets"] == 0


def test_the_comm_hook_mode_still_times_every_bucket_and_shows_what_it_costs(ranks: list[Rank]) -> None:
    for rank in ranks:
        assert rank["comm_hooks"]["hooked"] == 1
        for step in rank["steps"]:
            plain, watched, hooked = step["plain"], step["watched"], step["hooked"]
            assert (hooked["buckets"], hooked["bucket_bytes"]) == (watched["buckets"], rank["param_bytes"])
            # torch's allreduce_hook divides each bucket in a pass of its own ...
            assert hooked["div_calls"] == plain["div_calls"] + hooked["buckets"]
            # ... after the copy: x / 3 where DDP computes x * (1/3) while copying, so in the last
            # bit the gradients differ. What the first test's bit-for-bit check would catch.
            assert not hooked["identical"]
            assert hooked["elements_differing"] > 0
