"""Prometheus file-based service discovery of a group's coordinators, written from etcd membership.

Each coordinator exports what it owns, so Prometheus scrapes all of them; this keeps the list of
their /metrics addresses in a file_sd_configs file (JSON), rewritten atomically whenever a
coordinator joins or leaves. Run it where Prometheus runs: ``clusterwatch sd-file PATH --etcd URLS``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from clusterwatch.coordinator.group.membership import Member, Members

logger = logging.getLogger(__name__)


def target_groups(members: Mapping[str, Member]) -> list[dict[str, object]]:
    """file_sd's JSON: one target group of every coordinator that serves /metrics, sorted by shard."""
    targets = [m.metrics_address for _, m in sorted(members.items()) if m.metrics_address]
    return [{"targets": targets, "labels": {}}] if targets else []


def write(path: Path, members: Mapping[str, Member]) -> None:
    """Replace ``path`` at once (Prometheus never reads half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(target_groups(members), indent=2) + "\n")
    tmp.replace(path)


async def keep_written(members: Members, path: Path) -> None:
    """Write ``path`` now and after every change, until cancelled (``members`` must be watched)."""
    while True:
        await members.changed.wait()
        members.changed.clear()
        write(path, members.current)
        logger.info(
            "%s: %d coordinator(s): %s", path, len(members.current), ", ".join(sorted(members.current))
        )
