"""systemd's notify protocol (``sd_notify(3)``) for Type=notify services, in plain stdlib.

systemd passes a datagram socket in ``NOTIFY_SOCKET`` (a path, or an abstract
name written with a leading ``@``) and expects newline-separated
``KEY=VALUE`` assignments on it: ``READY=1`` once the service works,
``STATUS=...`` for ``systemctl status``, ``WATCHDOG=1`` at least every
``WATCHDOG_USEC`` microseconds when ``WatchdogSec=`` is set, ``STOPPING=1``
when it shuts down.

Without ``NOTIFY_SOCKET`` (not started by systemd, or not Type=notify) every
call does nothing. A send never blocks (a full socket drops the message) and
never raises: notification is a courtesy to the service manager and must not
take the daemon down; the first failure is logged at warning, later ones at
debug.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Mapping

# The name it had before clusterwatch/runtime/ (tests/deploy/test_systemd.py and log filters use it).
logger = logging.getLogger("clusterwatch.sd_notify")

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"
WATCHDOG_USEC_ENV = "WATCHDOG_USEC"
WATCHDOG_PID_ENV = "WATCHDOG_PID"

READY = "READY=1"
STOPPING = "STOPPING=1"
WATCHDOG = "WATCHDOG=1"

# Which NOTIFY_SOCKET values already had a failure logged at warning.
_warned: set[str] = set()


def status(text: str) -> str:
    """A ``STATUS=`` assignment; newlines would start new assignments, so they become spaces."""
    return "STATUS=" + " ".join(text.splitlines())


def notify(*assignments: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send assignments such as ``READY=1`` to systemd in one datagram.

    Args:
        *assignments: ``KEY=VALUE`` strings (see the module constants and ``status``).
        environ: where ``NOTIFY_SOCKET`` is read (default: ``os.environ``).

    Returns:
        True when the datagram was sent; False when there is no ``NOTIFY_SOCKET``
        or the send failed (logged, never raised).
    """
    address = (os.environ if environ is None else environ).get(NOTIFY_SOCKET_ENV, "")
    if not address or not assignments:
        return False
    # An abstract socket name is written with '@' and bound with a leading NUL.
    target = "\0" + address[1:] if address.startswith("@") else address
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)  # a receiver that stopped reading must not stall our loop
            sock.sendto("\n".join(assignments).encode(), target)
    except (OSError, ValueError) as exc:  # ValueError: a NUL inside a path
        level = logging.DEBUG if address in _warned else logging.WARNING
        _warned.add(address)
        logger.log(level, "cannot notify systemd on %s=%s: %s", NOTIFY_SOCKET_ENV, address, exc)
        return False
    return True


def watchdog_interval_s(environ: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """How often to send ``WATCHDOG=1``: half of ``WATCHDOG_USEC``, as sd_watchdog_enabled(3) advises.

    Args:
        environ: where the variables are read (default: ``os.environ``).
        pid: this process's id (default: ``os.getpid()``).

    Returns:
        Seconds between pings, or None when no watchdog is asked of this
        process: no or an unusable ``WATCHDOG_USEC``, or a ``WATCHDOG_PID``
        naming another process (the variables were inherited from a parent).
    """
    environ = os.environ if environ is None else environ
    try:
        watchdog_us = int(environ.get(WATCHDOG_USEC_ENV, ""))
    except ValueError:
        return None
    if watchdog_us <= 0:
        return None
    watchdog_pid = environ.get(WATCHDOG_PID_ENV, "")
    if watchdog_pid:
        try:
            if int(watchdog_pid) != (os.getpid() if pid is None else pid):
                return None
        except ValueError:
            return None
    return watchdog_us / 2 / 1_000_000


async def ping_watchdog(interval_s: float) -> None:
    """Send ``WATCHDOG=1`` every ``interval_s`` until cancelled.

    Run it as a task on the daemon's main event loop: if that loop wedges,
    the pings stop and systemd restarts the service (``WatchdogSec=``).
    """
    while True:
        notify(WATCHDOG)
        await asyncio.sleep(interval_s)


def start_watchdog() -> asyncio.Task[None] | None:
    """A ``ping_watchdog`` task on the running loop when systemd asked for pings; else None."""
    interval_s = watchdog_interval_s()
    if interval_s is None or not os.environ.get(NOTIFY_SOCKET_ENV):
        return None
    logger.debug("sending systemd watchdog pings every %.3g s", interval_s)
    return asyncio.get_running_loop().create_task(ping_watchdog(interval_s), name="systemd-watchdog")


async def stop_watchdog(task: asyncio.Task[None] | None) -> None:
    """Cancel a ``start_watchdog`` task and wait for it to end."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
