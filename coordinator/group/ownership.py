"""Who owns a job or a node among the live coordinators: rendezvous (highest-random-weight) hashing.

Every coordinator and agent computes the same answer from the same membership, with no table to
store or agree on. When a coordinator leaves, only what it owned moves (each item to the shard that
ranked second for it); when one joins, it takes from each of the others about 1/n of their share.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable


def weight(shard_id: str, item: str) -> int:
    """The pseudo-random weight of ``item`` on ``shard_id``: the same everywhere, for every Python."""
    digest = hashlib.blake2b(f"{shard_id}\0{item}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def owner(item: str, shard_ids: Collection[str]) -> str:
    """The shard that owns ``item``: the highest weight (ties, impossible in practice, by shard id).

    Raises:
        ValueError: no shard.
    """
    if not shard_ids:
        raise ValueError(f"no coordinator to own {item!r}")
    return max(shard_ids, key=lambda shard: (weight(shard, item), shard))


def share(items: Iterable[str], shard_ids: Collection[str], shard_id: str) -> list[str]:
    """The items ``shard_id`` owns among ``shard_ids``, in the order given."""
    return [item for item in items if owner(item, shard_ids) == shard_id]
