"""A hostile training user on the hook socket, in its own process: says hello as rank after rank
from one process, then floods every stream with batches of new collective kinds.

Usage: python hook_flood.py SOCKET_PATH  -> prints one JSON line: how many batches each stream got
out before the agent ended it (a refused hello's stream gets none through).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: hook_client, builders
from hook_client import HookClient

from clusterwatch.v1 import hook_pb2, training_pb2
from clusterwatch.wire.collective_stats import COLLECTIVE_DURATION_BUCKETS_S

HELLOS = 10
BATCHES_PER_STREAM = 400  # far past any budget: the agent ends the stream first


def identity(number: int) -> training_pb2.RankIdentity:
    return training_pb2.RankIdentity(
        job=f"flood{number}",
        rank=0,
        local_rank=0,
        world_size=1,
        pid=os.getpid(),
        instance_id=f"i{number}",
        hook_version="flood",
    )


def batch(first_step: int) -> hook_pb2.StepBatch:
    """Two steps of 1,024 collective kinds never seen before (a new group each)."""
    steps = []
    for step in (first_step, first_step + 1):
        summary = training_pb2.StepSummary(
            step=step,
            start_unix_seconds=1e9 + step,
            step_seconds=0.5,
            communication_seconds=0.25,
            compute_seconds=0.25,
        )
        summary.collectives.extend(
            training_pb2.CollectiveSummary(
                op="all_reduce",
                group_name=f"g{step}-{n}",
                group_size=2,
                dtype="float32",
                size_bucket_bytes=1024,
                count=1,
                bytes_total=1000,
                duration_seconds_total=0.001,
                duration_bucket_counts=[1] + [0] * len(COLLECTIVE_DURATION_BUCKETS_S),
            )
            for n in range(1024)
        )
        steps.append(summary)
    return hook_pb2.StepBatch(steps=steps)


async def flood(hook: HookClient, base: int) -> int:
    sent = 0
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):  # the agent ended the stream
        for sent in range(BATCHES_PER_STREAM):
            await hook.send(steps=batch(base + 2 * sent))
    return sent


async def main(socket_path: Path) -> None:
    hooks = [HookClient(socket_path) for _ in range(HELLOS)]
    for number, hook in enumerate(hooks):
        with contextlib.suppress(
            grpc.aio.AioRpcError, asyncio.InvalidStateError
        ):  # refused: the flood finds out
            await hook.send(hello=identity(number))
    sent = await asyncio.gather(*(flood(hook, 1_000_000 * n) for n, hook in enumerate(hooks)))
    print(json.dumps({"batches_sent": sent}), flush=True)
    for hook in hooks:
        await hook.close()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
