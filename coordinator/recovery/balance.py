"""Each rank's share of a job's global batch, from what each rank computes per sample (rebalance).

Pure. A rank's throughput is its newest step's sample count (what the hook was
told: ``monitor.step(n, samples=len(batch))``) over its median compute time
(step time minus time blocked in collectives) over its last ``RECENT_STEPS``:
what it does per second when it is not waiting for others. Shares are
proportional to throughput, so that every rank's compute takes as long; each
is kept within [MIN_SHARE_FACTOR, MAX_SHARE_FACTOR] of the even share (one
measurement never starves a rank or hands it most of the batch: a rank whose
speed is misjudged is corrected by the next straggler finding, not amplified).
"""

from __future__ import annotations

import math
import statistics

from clusterwatch.coordinator.model.jobs import JobRecord

RECENT_STEPS = 20
MIN_SHARE_FACTOR = 0.25
MAX_SHARE_FACTOR = 4.0
# A new split no rank's share moves by this fraction is not worth a message: the job is balanced.
MIN_CHANGE_RATIO = 0.05
# Shares apply this far past the furthest rank: every rank has them before its data loader
# prepares that step's batch (a DataLoader works a few batches ahead).
LEAD_S = 5.0
MIN_LEAD_STEPS = 10


def batch_shares(job: JobRecord) -> list[float] | str:
    """Every rank's share (index: rank; sum 1), or why they cannot be worked out."""
    running = {record.rank: record for record in job.running_ranks()}
    world = job.world_size
    if sorted(running) != list(range(world)):
        return f"not every rank of the {world} is running"
    throughput: list[float] = []
    for rank in range(world):
        record = running[rank]
        last = record.last_step
        compute = list(record.steps.compute_s[-RECENT_STEPS:])
        if last is None or not last.samples or not compute:
            return f"rank {rank} reports no samples per step (monitor.step(n, samples=...))"
        median_s = statistics.median(compute)
        if median_s <= 0:
            return f"rank {rank} reports no compute time"
        throughput.append(last.samples / median_s)
    total = sum(throughput)
    even = 1.0 / world
    bounded = [min(max(t / total, MIN_SHARE_FACTOR * even), MAX_SHARE_FACTOR * even) for t in throughput]
    scale = sum(bounded)
    return [share / scale for share in bounded]


def current_shares(job: JobRecord) -> list[float] | None:
    """The split the ranks' newest steps had (their sample counts); None when unknown."""
    counts = {r.rank: r.last_step.samples for r in job.running_ranks() if r.last_step is not None}
    if sorted(counts) != list(range(job.world_size)) or not all(counts.values()):
        return None
    total = sum(c for c in counts.values() if c)
    return [(counts[rank] or 0.0) / total for rank in range(job.world_size)]


def worth_changing(current: list[float] | None, new: list[float]) -> bool:
    """Whether some rank's share moves by at least MIN_CHANGE_RATIO of itself."""
    if current is None or len(current) != len(new):
        return True
    return any(abs(n - c) >= MIN_CHANGE_RATIO * c for c, n in zip(current, new, strict=True))


def first_step(job: JobRecord) -> int:
    """A step no rank's data loader has prepared yet: LEAD_S of steps past the furthest rank."""
    records = job.running_ranks()
    furthest = max((r.last_step.step for r in records if r.last_step is not None), default=0)
    step_times = [s for r in records for s in r.steps.step_s[-RECENT_STEPS:]]
    step_s = statistics.median(step_times) if step_times else 0.0
    lead = max(MIN_LEAD_STEPS, math.ceil(LEAD_S / step_s) if step_s > 0 else MIN_LEAD_STEPS)
    return furthest + lead
