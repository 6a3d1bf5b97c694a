"""Which coordinator owns a job, and where a node's agent reports: rendezvous (highest-random-weight)
hashing over the live coordinators.

Every coordinator and agent computes the same answer from the same membership, with no table to
store or agree on. When a coordinator leaves, only what it owned moves (each item to the shard that
ranked second for it); when one joins, it takes from each of the others about 1/n of their share.

A job is owned by ``job_owner(job)``: its detection and its actions run there. A node is homed
where its **primary job** is owned (the job with most of its ranks; ties to the first job id), so
an exclusive node of a multi-node job (the common case: a SLURM or Kubernetes job holds whole
nodes) reports to one coordinator that has both its ranks and its GPUs' and NICs' state for
cause attribution, with no call between coordinators. A node that hosts no rank is homed by its
own id. A node shared by jobs owned by different coordinators has one home; the ranks of its
other jobs are not judged there (docs/deploy.md, "More than one coordinator").
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping


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


def job_owner(job: str, shard_ids: Collection[str]) -> str:
    """The shard that owns ``job``: it detects, and acts, for it."""
    return owner(f"job\0{job}", shard_ids)


def primary_job(ranks_by_job: Mapping[str, int]) -> str | None:
    """The job with most ranks on a node (ties: the first job id in sort order); None without ranks."""
    if not ranks_by_job:
        return None
    return min(ranks_by_job, key=lambda job: (-ranks_by_job[job], job))


def node_home(node_id: str, ranks_by_job: Mapping[str, int], shard_ids: Collection[str]) -> str:
    """The shard a node's agent reports to: its primary job's owner, or by its id when it hosts none."""
    job = primary_job(ranks_by_job)
    return job_owner(job, shard_ids) if job is not None else owner(f"node\0{node_id}", shard_ids)
