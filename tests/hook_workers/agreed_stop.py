"""A training loop's stop that every rank takes at the same step: once a file exists.

Test workers run until the test touches a file; a rank that saw it one step
before another would leave its peers in a collective it never joins. So the
ranks agree, with an all-reduce every ``EVERY`` steps (the only collective
this adds, and only then).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

EVERY = 20


def stop_asked(until_file: Path, step: int) -> bool:
    """True, on every rank at the same step, once ``until_file`` exists (checked every EVERY steps)."""
    if step % EVERY:
        return False
    stop = torch.tensor([float(until_file.exists())])
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    return bool(stop.item())
