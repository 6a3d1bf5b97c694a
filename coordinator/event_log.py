"""Durable history: node events and the node registry, in SQLite (WAL).

Writes are small and rare (state transitions, not reports), so they run
synchronously on the caller's thread in one transaction per batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path

from clusterwatch.coordinator.state import Event

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    timestamp_unix_s REAL NOT NULL,
    kind TEXT NOT NULL,
    node_id TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS events_node ON events (node_id, id);
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY,
    hostname TEXT NOT NULL,
    interval_s REAL NOT NULL,
    first_seen_unix_s REAL NOT NULL
);
"""


@dataclasses.dataclass(frozen=True)
class StoredEvent:
    id: int
    timestamp_unix_s: float
    kind: str
    node_id: str
    detail: str


@dataclasses.dataclass(frozen=True)
class StoredNode:
    node_id: str
    hostname: str
    interval_s: float


class EventLog:
    """The coordinator's SQLite database in ``state_dir/clusterwatch.db``."""

    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / "clusterwatch.db"
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.path} has schema {version}, newer than this clusterwatch ({SCHEMA_VERSION})"
            )
        self._db.executescript(SCHEMA)
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def append(self, events: Iterable[Event]) -> None:
        rows = [(e.timestamp_unix_s, e.kind.value, e.node_id, e.detail) for e in events]
        if not rows:
            return
        with self._transaction():
            self._db.executemany(
                "INSERT INTO events (timestamp_unix_s, kind, node_id, detail) VALUES (?, ?, ?, ?)", rows
            )

    def upsert_node(self, node_id: str, hostname: str, interval_s: float, now_unix_s: float) -> None:
        with self._transaction():
            self._db.execute(
                "INSERT INTO nodes (node_id, hostname, interval_s, first_seen_unix_s) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (node_id) DO UPDATE SET hostname = excluded.hostname, interval_s = excluded.interval_s",
                (node_id, hostname, interval_s, now_unix_s),
            )

    def nodes(self) -> list[StoredNode]:
        rows = self._db.execute("SELECT node_id, hostname, interval_s FROM nodes ORDER BY node_id").fetchall()
        return [StoredNode(*row) for row in rows]

    def events(self, after_id: int = 0, limit: int = 1000, node_id: str = "") -> list[StoredEvent]:
        """Events with id above ``after_id``: the newest ``limit`` of them, oldest first."""
        query = "SELECT id, timestamp_unix_s, kind, node_id, detail FROM events WHERE id > ?"
        params: list[object] = [after_id]
        if node_id:
            query += " AND node_id = ?"
            params.append(node_id)
        query += " ORDER BY id DESC LIMIT ?"
        params.append(limit)
        rows = self._db.execute(query, params).fetchall()
        return [StoredEvent(*row) for row in reversed(rows)]

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        # isolation_level=None leaves transactions to us: one per batch.
        self._db.execute("BEGIN")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
