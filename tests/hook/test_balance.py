"""Uneven batches for uneven ranks (clusterwatch/hook/balance.py): the split, the shares in force at
each step, the sampler's disjoint parts, and that weighted losses make the update an even split makes
(a real two-rank gloo job: tests/hook_workers/balanced_sgd.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import Cluster

from clusterwatch.hook.balance import BalancedBatchSampler, BatchShares, loss_weight, split

pytestmark = pytest.mark.timeout(120)
WORKER = Path(__file__).resolve().parents[1] / "hook_workers" / "balanced_sgd.py"


def test_a_split_is_proportional_gives_every_rank_a_sample_and_adds_up() -> None:
    assert split(64, (0.25, 0.25, 0.25, 0.25)) == [16, 16, 16, 16]
    assert split(64, (0.4, 0.2, 0.2, 0.2)) == [25, 13, 13, 13]  # 25.6, 12.8 x 3: largest remainders
    assert split(4, (0.97, 0.01, 0.01, 0.01)) == [1, 1, 1, 1]
    for batch in range(4, 40):
        assert sum(split(batch, (3.0, 1.0, 2.0, 0.5))) == batch
    with pytest.raises(ValueError, match="cannot give each of 4 ranks a sample"):
        split(3, (1.0, 1.0, 1.0, 1.0))


def test_shares_are_even_until_their_step_and_a_later_change_replaces_a_pending_one() -> None:
    shares = BatchShares()
    assert shares.at(5, 2) == (0.5, 0.5)
    shares.set([3.0, 1.0], from_step=10)
    assert shares.at(9, 2) == (0.5, 0.5)
    assert shares.at(10, 2) == (0.75, 0.25)
    shares.set([1.0, 1.0, 2.0], from_step=20)
    assert shares.at(25, 2) == (0.5, 0.5), "shares for another world size are not used"
    shares.set([1.0, 3.0], from_step=15)  # replaces the change from step 20
    assert (shares.at(14, 2), shares.at(30, 2)) == ((0.75, 0.25), (0.25, 0.75))
    with pytest.raises(ValueError, match="positive"):
        shares.set([1.0, 0.0], from_step=40)


def test_the_ranks_parts_of_each_step_are_disjoint_and_make_the_global_batch() -> None:
    class Monitor:
        def __init__(self) -> None:
            self.shares = BatchShares()
            self.accepted = False

        def accept_batch_shares(self) -> None:
            self.accepted = True

        def batch_shares(self, step: int) -> tuple[float, ...]:
            return self.shares.at(step, 3)

    monitor = Monitor()
    monitor.shares.set([2.0, 1.0, 1.0], from_step=3)
    samplers = [
        BalancedBatchSampler(120, 12, rank=r, world_size=3, monitor=monitor, seed=7)  # type: ignore[arg-type]
        for r in range(3)
    ]
    assert monitor.accepted
    batches = [list(s) for s in samplers]
    assert len(batches[0]) == 10
    for step in range(10):
        parts = [b[step] for b in batches]
        assert [len(p) for p in parts] == ([4, 4, 4] if step < 3 else [6, 3, 3])
        joined = sorted(i for part in parts for i in part)
        assert len(set(joined)) == 12, "disjoint"
        assert joined == sorted(batches[0][step] + batches[1][step] + batches[2][step])
    every = sorted(i for b in batches for part in b for i in part)
    assert every == list(range(120)), "one epoch covers the data set once"
    assert samplers[0].loss_weight(5) == loss_weight(6, 12, 3) == 1.5


def test_weighted_losses_make_the_update_an_even_split_makes(cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "curves.json"
    job = cluster.torchrun(WORKER, "--out", str(out), nproc=2, socket=None)
    assert job.wait(90) == 0, job.log()
    curves = json.loads(out.read_text())
    even, uneven = curves["even"], curves["uneven"]
    assert curves["counts"][0] != curves["counts"][1], "the uneven run really split unevenly"
    assert len(even) == len(uneven) == 20
    assert even == pytest.approx(uneven, rel=1e-5, abs=1e-7)
    assert curves["parameters_max_difference"] < 1e-5
    assert even[-1] < even[0], "it trained"
