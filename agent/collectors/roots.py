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

# Values drivers write to a net device's ``speed`` when they do not know it:
# SPEED_UNKNOWN (-1) and, from older drivers, the same value through u16/u32 casts.
_UNKNOWN_SPEEDS_MBIT_S = frozenset({-1, 0xFFFF, 0xFFFFFFFF})


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


def parse_net_speed(text: str | None) -> float | None:
    """A net device's ``speed`` attribute (Mb/s, 10^6 bits/s) in bytes/s; None when unknown.

    Reading ``speed`` of a down or virtual interface fails (EINVAL) or gives
    -1; both are "unknown", not zero.
    """
    if text is None:
        return None
    try:
        speed_mbit_s = int(text)
    except ValueError:
        logger.debug("unparseable NIC speed %r", text)
        return None
    if speed_mbit_s <= 0 or speed_mbit_s in _UNKNOWN_SPEEDS_MBIT_S:
        return None
    return speed_mbit_s * 1e6 / 8


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
