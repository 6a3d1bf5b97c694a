"""Reading the system roots (procfs, sysfs) that collectors take as arguments."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

_ATTR_READ_BYTES = 4096  # a sysfs attribute is at most one page


def read_attr(path: str | os.PathLike[str]) -> str | None:
    """One sysfs attribute, stripped, with one open and one read; None if unreadable.

    Unsupported counters on some devices fail to read with EINVAL or
    EOPNOTSUPP; that is expected and logged at debug level only.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.read(fd, _ATTR_READ_BYTES)
        finally:
            os.close(fd)
        return data.decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        logger.debug("cannot read %s: %r", path, exc)
        return None


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
