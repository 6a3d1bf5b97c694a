"""Owning the hook socket's path: one agent per path, stale files cleaned up, mode 0660.

An agent takes an exclusive lock on ``<socket>.lock`` for its lifetime, so
two agents starting at once cannot both decide the socket is stale. Holding
the lock, a socket file found at the path (or at a companion path, such as
the credential socket) was left by a dead agent and is removed — unless
something still answers on it, which is refused. Every socket gets mode 0660
and, when configured (``agent.socket_group``), that group: the users allowed
to connect are the socket's owner and the group's members.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import logging
import os
import socket
import stat
from collections.abc import Sequence
from pathlib import Path

from clusterwatch.errors import ConfigError

logger = logging.getLogger(__name__)

SOCKET_MODE = 0o660
DIRECTORY_MODE = 0o755  # hooks run as other users; the socket's own mode guards it
PROBE_TIMEOUT_S = 1.0
# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
MAX_GID = 2**32 - 2  # (gid_t)-1 means "unchanged" to chown
GROUP_KEY = "agent.socket_group"


class HookSocketError(ConfigError):
    """The hook socket path cannot be used (too long, in use, not a socket).

    A ConfigError (key ``agent.socket``) so the command line reports it in one
    line and exits with code 2, like any other unusable setting.
    """

    def __init__(self, message: str) -> None:
        super().__init__("agent.socket", message)


def resolve_group(spec: str) -> int | None:
    """The gid the setting ``agent.socket_group`` names: a group name or a number; None if empty.

    Raises:
        ConfigError: no such group name on this host, or a number out of range.
    """
    spec = spec.strip()
    if not spec:
        return None
    if spec.isdigit():
        gid = int(spec)
        if gid > MAX_GID:
            raise ConfigError(GROUP_KEY, f"gid {gid} is out of range (at most {MAX_GID})")
        return gid
    try:
        return grp.getgrnam(spec).gr_gid
    except KeyError:
        raise ConfigError(GROUP_KEY, f"no group named {spec!r} on this host") from None


class SocketClaim:
    """This agent's hold on the socket path (and its companions), from ``claim()`` until ``release()``.

    Args:
        path: where the socket will be bound; the lock is ``<path>.lock``.
        companions: more sockets this agent binds next to it, held by the same lock.
        group: the gid the sockets are given; None leaves the agent's own.
    """

    def __init__(self, path: Path, *, companions: Sequence[Path] = (), group: int | None = None) -> None:
        self.path = path
        self.paths = (path, *companions)
        self.group = group
        self._lock_fd: int | None = None
        self._inodes: dict[Path, tuple[int, int]] = {}

    def claim(self) -> None:
        """Prepare the paths for binding: directory, lock, stale sockets removed.

        Raises:
            HookSocketError: another agent holds the path, something listens on
                one of them, a non-socket file is in the way, or a path is too long.
        """
        for path in self.paths:
            if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
                raise HookSocketError(f"{path} is longer than {MAX_SOCKET_PATH_BYTES} bytes")
        try:
            self.path.parent.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
        except OSError as exc:
            raise HookSocketError(f"cannot create {self.path.parent}: {exc.strerror}") from None
        self._lock()
        try:
            for path in self.paths:
                self._remove_stale(path)
        except HookSocketError:
            self.release()
            raise

    def bound(self, path: Path | None = None) -> None:
        """Call once a server has bound ``path`` (default: the main socket), before it accepts.

        Gives the socket its group and mode 0660, and remembers which file is ours.

        Raises:
            ConfigError: (``agent.socket_group``) the agent may not give the socket that group.
        """
        path = self.path if path is None else path
        if self.group is not None:
            try:
                os.chown(path, -1, self.group)
            except OSError as exc:
                raise ConfigError(
                    GROUP_KEY,
                    f"cannot give {path} to group {self.group}: {exc.strerror} "
                    "(the agent must run as root or be a member of that group)",
                ) from None
        os.chmod(path, SOCKET_MODE)
        info = os.stat(path)
        self._inodes[path] = (info.st_dev, info.st_ino)

    def release(self) -> None:
        """Remove our sockets (not a successor's) and drop the lock."""
        for path, inode in self._inodes.items():
            with contextlib.suppress(FileNotFoundError):
                info = os.stat(path)
                if inode == (info.st_dev, info.st_ino):
                    path.unlink()
        self._inodes.clear()
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

    @staticmethod
    def _remove_stale(path: Path) -> None:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise HookSocketError(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(PROBE_TIMEOUT_S)
        try:
            probe.connect(os.fspath(path))
        except (ConnectionRefusedError, FileNotFoundError):
            pass  # nobody listens: left behind by an agent that died
        except OSError as exc:
            raise HookSocketError(f"cannot check whether {path} is in use: {exc.strerror or exc}") from None
        else:
            raise HookSocketError(
                f"another process is listening on {path}; stop it or give this agent another socket"
            )
        finally:
            probe.close()
        path.unlink(missing_ok=True)
        logger.info("removed stale hook socket %s left by an agent that is gone", path)
