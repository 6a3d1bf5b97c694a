"""The node's worker environments: what WorkerEnvCommands set, kept where the hooks read it.

One file next to the hook socket (clusterwatch/wire/worker_env.py), replaced
whole on each change (written beside it, then renamed over it, so a hook never
reads half of one). It outlives the agent: a job stays off a bad interface
across an agent restart, until its entry lapses or is cleared.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from clusterwatch.v1 import node_pb2
from clusterwatch.wire.worker_env import WorkerEnv, WorkerEnvError, check_env, decode, encode

logger = logging.getLogger(__name__)

FILE_MODE = 0o644  # every training user reads it; only the agent writes


class WorkerEnvBook:
    """The entries of one node, by job.

    Args:
        path: the file (``env_file_path(hook socket)``).
        clock: wall-clock seconds (expiry).
    """

    def __init__(self, path: Path, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock
        self._entries: dict[str, WorkerEnv] = {}
        try:
            self._entries = decode(path.read_bytes())
        except FileNotFoundError:
            pass
        except (OSError, WorkerEnvError) as exc:
            logger.warning("worker environments: ignoring %s: %s", path, exc)

    def entries(self) -> dict[str, WorkerEnv]:
        """The live entries."""
        now = self._clock()
        return {job: entry for job, entry in self._entries.items() if entry.live(now)}

    def set(
        self,
        job: str,
        env: Mapping[str, str],
        reason: str,
        expires_unix_s: float,
        avoided: Sequence[str] = (),
    ) -> None:
        """Give ``job``'s workers that start from now ``env`` (empty: clear its entry), to keep them off
        ``avoided`` ("NODE/INTERFACE").

        Raises:
            WorkerEnvError: a variable that may not be set, or no job.
            OSError: the file could not be written (nothing changed then).
        """
        if not job:
            raise WorkerEnvError("no job named")
        check_env(env)
        entries = self.entries()
        if env:
            entries[job] = WorkerEnv(dict(env), reason, expires_unix_s, tuple(avoided))
        else:
            entries.pop(job, None)
        self._write(entries)
        self._entries = entries

    def report(self) -> list[node_pb2.WorkerEnvEntry]:
        """The live entries, for the node report (which jobs are kept off which interfaces)."""
        return [
            node_pb2.WorkerEnvEntry(
                job=job,
                env=entry.env,
                reason=entry.reason,
                expires_unix_seconds=entry.expires_unix_s,
                avoided_interfaces=entry.avoided,
            )
            for job, entry in sorted(self.entries().items())
        ]

    def _write(self, entries: Mapping[str, WorkerEnv]) -> None:
        staging = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
            with os.fdopen(fd, "wb") as out:
                out.write(encode(entries))
            os.chmod(staging, FILE_MODE)  # whatever the umask left
            os.replace(staging, self.path)
        except OSError:
            staging.unlink(missing_ok=True)
            raise
