"""One sysfs attribute, read with errors as data, and the kernel's cpulist format.

Every room that reads sysfs (GPU backends, topology discovery, collectors)
reads attributes through :func:`read_attr`: one open and one read, and an
unreadable attribute is None, not an exception (CONTRIBUTING.md #3).
"""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger(__name__)

_ATTR_READ_BYTES = 4096  # a sysfs attribute is at most one page

# A kernel cpulist: "0-31,64-95", "7", "" (no CPUs).
_CPULIST_RE = re.compile(r"^(\d+(-\d+)?)(,\d+(-\d+)?)*$")


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


def parse_cpulist(text: str | None) -> str | None:
    """A kernel cpulist as it is (``"0-31,64-95"``, ``""``); None when malformed."""
    if text is None:
        return None
    return text if text == "" or _CPULIST_RE.match(text) else None
