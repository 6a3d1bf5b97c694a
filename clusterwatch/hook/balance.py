"""Uneven batches for uneven ranks: each rank's share of the global batch, and a sampler that uses it.

A rank that is persistently slower because of what it runs on (an older GPU,
a slower host) makes every other rank wait at each step's all-reduce.
Leaving it out wastes what it can do; giving it less of each global batch
does not. The coordinator measures each rank's compute throughput and, for a
job that opted in, sends every rank the same shares, in force from a step
far enough ahead that every rank has them (``BatchShares``). Until then, and
for a job that never gets any, every rank's share is 1/world size.

The update stays the one an even split makes: DDP averages gradients over the
ranks, so each rank weighs its mean loss by ``local samples x world size /
global batch`` (``loss_weight``); the average of the weighted gradients is then
the gradient of the mean loss over the whole global batch, whatever the split.

``BalancedBatchSampler`` splits each step's global batch (a slice of one
permutation of the data set, the same on every rank) by the shares in force
at that step: ranks get disjoint, contiguous parts of it. It numbers steps as
``epoch x steps_per_epoch + i`` (from ``start_step``), as ``monitor.step(n)``
should, since shares apply from a step number.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clusterwatch.hook.monitor import TrainingMonitor

logger = logging.getLogger("clusterwatch.hook")


class BatchShares:
    """The shares in force at each step: even until the first change. Thread-safe (commands
    arrive on the hook's thread, the sampler reads on the training thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._from_steps: list[int] = []
        self._shares: list[tuple[float, ...]] = []

    def set(self, shares: Sequence[float], from_step: int) -> None:
        """Use ``shares`` (by rank) from ``from_step`` on; replaces any later change."""
        checked = tuple(float(share) for share in shares)
        if not checked or any(not math.isfinite(s) or s <= 0 for s in checked):
            raise ValueError(f"shares must be positive numbers, got {list(shares)}")
        total = sum(checked)
        with self._lock:
            keep = bisect.bisect_left(self._from_steps, from_step)
            del self._from_steps[keep:], self._shares[keep:]
            self._from_steps.append(from_step)
            self._shares.append(tuple(share / total for share in checked))

    def at(self, step: int, world_size: int) -> tuple[float, ...]:
        """The shares in force at ``step``; even when none are, or when they are for another world size."""
        with self._lock:
            index = bisect.bisect_right(self._from_steps, step) - 1
            shares = self._shares[index] if index >= 0 else ()
        return shares if len(shares) == world_size else (1.0 / world_size,) * world_size


def split(global_batch: int, shares: Sequence[float]) -> list[int]:
    """Each rank's sample count of ``global_batch``: proportional to its share (largest
    remainders first, ties to the lower rank), at least 1, summing to ``global_batch``."""
    world = len(shares)
    if global_batch < world:
        raise ValueError(f"a global batch of {global_batch} cannot give each of {world} ranks a sample")
    total = sum(shares)
    exact = [global_batch * share / total for share in shares]
    counts = [max(1, math.floor(value)) for value in exact]
    by_remainder = sorted(range(world), key=lambda r: (-(exact[r] - math.floor(exact[r])), r))
    for rank in by_remainder[: max(0, global_batch - sum(counts))]:
        counts[rank] += 1
    while sum(counts) > global_batch:  # the floor of 1 took samples from the others
        spare = [r for r in range(world) if counts[r] > 1]
        counts[max(spare, key=lambda r: (counts[r] - exact[r], counts[r]))] -= 1
    return counts


def loss_weight(local_samples: int, global_batch: int, world_size: int) -> float:
    """What a rank multiplies its mean loss by so that DDP's average of the ranks' gradients is the
    gradient of the mean loss over the global batch (1.0 for an even split)."""
    return local_samples * world_size / global_batch


class BalancedBatchSampler:
    """Yields this rank's sample indices for each step: its part of the step's global batch.

    Use as a DataLoader's ``batch_sampler``. Passing the monitor opts the job in to rebalancing
    (the coordinator may then send shares); without one every split is even.

    Args:
        dataset_size: samples in the data set.
        global_batch: samples per step over all ranks.
        rank / world_size: default: the process group's.
        monitor: the TrainingMonitor whose shares to follow (default: this process's, if any).
        shuffle / seed: one permutation per epoch, the same on every rank.
        start_step: the step number of the first batch (a resumed job's resume step).
    """

    def __init__(
        self,
        dataset_size: int,
        global_batch: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        monitor: TrainingMonitor | None = None,
        shuffle: bool = True,
        seed: int = 0,
        start_step: int = 0,
    ) -> None:
        if rank is None or world_size is None:
            import torch.distributed as dist

            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        if global_batch > dataset_size:
            raise ValueError(f"a global batch of {global_batch} is more than the {dataset_size} samples")
        split(global_batch, (1.0,) * world_size)  # refuses a batch too small for the ranks
        self.dataset_size = dataset_size
        self.global_batch = global_batch
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.start_step = start_step
        self.epoch = 0
        if monitor is None:
            from clusterwatch.hook.monitor import current_monitor

            monitor = current_monitor()
        self.monitor = monitor
        if monitor is not None:
            monitor.accept_batch_shares()

    def __len__(self) -> int:
        return self.dataset_size // self.global_batch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def step_of(self, index: int) -> int:
        """The step number of this epoch's ``index``-th batch."""
        return self.start_step + self.epoch * len(self) + index

    def counts(self, step: int) -> list[int]:
        """Every rank's sample count at ``step``."""
        shares = (
            self.monitor.batch_shares(step)
            if self.monitor is not None
            else (1.0 / self.world_size,) * self.world_size
        )
        return split(self.global_batch, shares)

    def loss_weight(self, step: int) -> float:
        """This rank's loss weight at ``step`` (see the module docstring)."""
        return loss_weight(self.counts(step)[self.rank], self.global_batch, self.world_size)

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        for index in range(len(self)):
            counts = self.counts(self.step_of(index))
            start = index * self.global_batch + sum(counts[: self.rank])
            yield order[start : start + counts[self.rank]]

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_size))
        import torch

        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        permutation: Any = torch.randperm(self.dataset_size, generator=generator)
        return [int(i) for i in permutation.tolist()]
