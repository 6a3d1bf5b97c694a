"""Owning the hook socket's path: one agent per path, stale files cleaned up, mode 0660.

An agent takes an exclusive lock on ``<socket>.lock`` for its lifetime, so
two agents starting at once cannot both decide the socket is stale. Holding
the lock, a socket file found at the path was left by a dead agent and is
removed — unless something still answers on it, which is refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import stat
from pathlib import Path

from clusterwatch.errors import ConfigError

logger = logging.getLogger(__name__)

SOCKET_MODE = 0o660
DIRECTORY_MODE = 0o755  # hooks run as other users; the socket's own mode guards it
PROBE_TIMEOUT_S = 1.0
# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107


class HookSocketError(ConfigError):
    """The hook socket path cannot be used (too long, in use, not a socket).

    A ConfigError (key ``agent.socket``) so the command line reports it in one
    line and exits with code 2, like any other unusable setting.
    """

    def __init__(self, message: str) -> None:
        super().__init__("agent.socket", message)


class SocketClaim:
    """This agent's hold on the socket path, from ``claim()`` until ``release()``.

    Args:
        path: where the socket will be bound.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_fd: int | None = None
        self._inode: tuple[int, int] | None = None

    def claim(self) -> None:
        """Prepare the path for binding: directory, lock, stale socket removed.

        Raises:
            HookSocketError: another agent holds the path, something listens on
                it, a non-socket file is in the way, or the path is too long.
        """
        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH_BYTES:
            raise HookSocketError(f"{self.path} is longer than {MAX_SOCKET_PATH_BYTES} bytes")
        try:
            self.path.parent.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
        except OSError as exc:
            raise HookSocketError(f"cannot create {self.path.parent}: {exc.strerror}") from None
        self._lock()
        try:
            self._remove_stale()
        except HookSocketError:
            self.release()
            raise

    def bound(self) -> None:
        """Call once the server has bound the socket: set its mode and remember which file is ours."""
        os.chmod(self.path, SOCKET_MODE)
        info = os.stat(self.path)
        self._inode = (info.st_dev, info.st_ino)

    def release(self) -> None:
        """Remove our socket (not a successor's) and drop the lock."""
        with contextlib.suppress(FileNotFoundError):
            info = os.stat(self.path)
            if self._inode == (info.st_dev, info.st_ino):
                self.path.unlink()
        self._inode = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None

    def _lock(self) -> None:
        lock_path = self.path.with_name(self.path.name + ".lock")
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise HookSocketError(f"cannot open {lock_path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise HookSocketError(
                    f"{self.path} is in use by another clusterwatch agent (it holds {lock_path}); "
                    "stop that agent or give this one another socket"
                ) from None
            raise HookSocketError(f"cannot lock {lock_path}: {exc.strerror}") from None
        self._lock_fd = fd

    def _remove_stale(self) -> None:
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise HookSocketError(f"{self.path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(PROBE_TIMEOUT_S)
        try:
            probe.connect(os.fspath(self.path))
        except (ConnectionRefusedError, FileNotFoundError):
            pass  # nobody listens: left behind by an agent that died
        except OSError as exc:
            raise HookSocketError(
                f"cannot check whether {self.path} is in use: {exc.strerror or exc}"
            ) from None
        else:
            raise HookSocketError(
                f"another process is listening on {self.path}; stop it or give this agent another socket"
            )
        finally:
            probe.close()
        self.path.unlink(missing_ok=True)
        logger.info("removed stale hook socket %s left by an agent that is gone", self.path)
