"""Which process groups this rank belongs to, and their members (global ranks).

The Flight Recorder's ``pg_config`` would say, but on gloo it comes back empty,
so this reads what that config is built from: torch.distributed's own registry,
``distributed_c10d._world`` (``pg_names``: group -> name, ``pg_group_ranks``:
group -> {global rank: group rank}, ``group.group_desc``). A rank registers
only the groups it belongs to; groups of one member are left out.

Members go as a progression (``first_rank``, ``stride``, ``size``; ``ranks``
empty) when the sorted global ranks are evenly spaced, as every DeviceMesh
dimension's are; otherwise ``ranks`` lists them, ``stride`` is 0,
``first_rank`` the lowest and ``size`` the count. A group that is no
progression and has more members than the agent takes in one repeated field
is left out (and logged), as is one whose name is longer than the agent
takes: the agent refuses the whole heartbeat over either.

The registry is private API: if it is missing or changed, the read fails, the
failure is counted in the hook's health (CONTRIBUTING.md #3) and reads as no groups.
It runs on the heartbeat thread while the training thread may be creating a
group: the dicts are copied first, and one that changed under the copy is
read again at the next heartbeat. The registry rarely changes, so the
messages are built only when the set of registered groups did; otherwise a
read costs a few microseconds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from clusterwatch.hook.health import HookHealth
from clusterwatch.v1 import training_pb2

logger = logging.getLogger("clusterwatch.hook")

# The agent's limits (agent/hook_validation.py, which the hook may not import):
# entries per repeated field, characters per name and per description.
MAX_ENTRIES = 1024
MAX_NAME_CHARS = 256
MAX_DESCRIPTION_CHARS = 4096

# What identifies the registered groups at one moment: the ids of the named
# groups, their names, and the ids of the rank maps (torch makes a new map for
# every group and never changes one). Ids only, so no group is kept alive after
# torch destroys it; a new group at a freed group's address would also need its
# name and a rank map at the old map's address to pass for the old group.
_Signature = tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...]]


def membership(
    group_name: str, description: str, global_ranks: Iterable[int]
) -> training_pb2.ProcessGroupMembership | None:
    """One group's message; None for a group of fewer than two members or one too long to send.

    Args:
        group_name: the name torch gives the group ("0" is WORLD).
        description: its ``group_desc``; cut to MAX_DESCRIPTION_CHARS.
        global_ranks: its members, in any order.
    """
    ranks = sorted(set(global_ranks))
    size = len(ranks)
    if size < 2 or len(group_name) > MAX_NAME_CHARS:
        return None
    group = training_pb2.ProcessGroupMembership(
        group_name=group_name, description=description[:MAX_DESCRIPTION_CHARS], first_rank=ranks[0], size=size
    )
    stride = ranks[1] - ranks[0]
    if all(ranks[i + 1] - ranks[i] == stride for i in range(1, size - 1)):
        group.stride = stride
    elif size <= MAX_ENTRIES:
        group.ranks.extend(ranks)
    else:
        return None
    return group


class ProcessGroupReader:
    """Reads this rank's process groups, rebuilding the messages only when the registry changed.

    Args:
        world: a stand-in for ``torch.distributed.distributed_c10d._world``
            (anything with ``pg_names`` and ``pg_group_ranks``); default: torch's.
    """

    def __init__(self, world: Any = None) -> None:
        self._world = world
        self._cache: tuple[_Signature | None, list[training_pb2.ProcessGroupMembership]] = (None, [])

    def read(self, health: HookHealth | None = None) -> list[training_pb2.ProcessGroupMembership]:
        """The groups of more than one member this rank belongs to, sorted by name (as strings).

        Never raises: before ``init_process_group`` (or without
        torch.distributed) the list is empty, and a failure is counted in
        ``health`` (when given) and reads as empty too. Do not modify the
        messages: they are reused until the registry changes.
        """
        try:
            return self._read()
        except Exception as exc:  # private API: missing or changed in this torch
            if health is not None:
                health.record("process groups", exc)
            else:
                logger.debug("clusterwatch: cannot read the process groups: %r", exc)
            return []

    def _read(self) -> list[training_pb2.ProcessGroupMembership]:
        world = self._world
        if world is None:
            import torch.distributed as dist

            if not dist.is_available():
                return []
            world = dist.distributed_c10d._world
        signature, groups = self._cache
        names, members = world.pg_names, world.pg_group_ranks
        try:
            # Taken before the copies the messages are built from, so those are never
            # older than what the cache says they show.
            now: _Signature = (tuple(map(id, names)), tuple(names.values()), tuple(map(id, members.values())))
            if now == signature:
                return list(groups)
            named, ranked = list(names.items()), list(members.items())
        except RuntimeError:  # a dict changed size under a copy: a group is being made; next heartbeat
            return list(groups)
        groups = _build(named, ranked)
        self._cache = (now, groups)
        return list(groups)


def _build(
    names: list[tuple[Any, str]], members: list[tuple[Any, dict[int, int]]]
) -> list[training_pb2.ProcessGroupMembership]:
    name_of = {id(pg): str(name) for pg, name in names}
    groups: list[training_pb2.ProcessGroupMembership] = []
    for pg, ranks in members:
        name = name_of.get(id(pg))
        if name is None:  # registered half-way: its name comes with a later heartbeat
            continue
        group = membership(name, str(getattr(pg, "group_desc", "") or ""), list(ranks))
        if group is not None:
            groups.append(group)
        elif len(name) > MAX_NAME_CHARS or len(ranks) > MAX_ENTRIES:
            logger.info(
                "clusterwatch: process group %.64r (%d members) not reported: its name is over %d "
                "characters, or its members are more than %d and not evenly spaced",
                name,
                len(ranks),
                MAX_NAME_CHARS,
                MAX_ENTRIES,
            )
    groups.sort(key=lambda g: g.group_name)
    if len(groups) > MAX_ENTRIES:
        logger.info("clusterwatch: %d process groups, reporting the first %d", len(groups), MAX_ENTRIES)
        del groups[MAX_ENTRIES:]
    return groups
