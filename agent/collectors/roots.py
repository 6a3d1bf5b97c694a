"""Pointing psutil at the procfs root that collectors take as an argument.

Reading sysfs attributes is ``agent/sysfs/``'s, shared with GPU backends and
topology discovery; this is the collectors' own procfs plumbing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import psutil


@contextlib.contextmanager
def psutil_procfs(proc_root: Path) -> Iterator[None]:
    """Point psutil at ``proc_root`` for the duration of the block.

    psutil.PROCFS_PATH is process-wide: collectors run one at a time, so
    setting and restoring it around each collection is safe.
    """
    previous = psutil.PROCFS_PATH
    psutil.PROCFS_PATH = str(proc_root)
    try:
        yield
    finally:
        psutil.PROCFS_PATH = previous
