"""Durable history: node events, the node registry, complete checkpoints, incidents and actions, in SQLite (WAL).

Writes are small and rare (state transitions and checkpoint completions, not
reports), so they run synchronously on the caller's thread in one
transaction per batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path

from clusterwatch.coordinator.checkpoints import CompletedCheckpoint, LatestCheckpoint
from clusterwatch.coordinator.incidents import Incident, IncidentState, Kind, Severity
from clusterwatch.coordinator.state import Event
from clusterwatch.v1 import cluster_pb2

logger = logging.getLogger(__name__)

# 2: checkpoints table; 3: incidents table; 4: actions table. Older databases
# gain them on open (CREATE IF NOT EXISTS).
SCHEMA_VERSION = 4
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
CREATE TABLE IF NOT EXISTS checkpoints (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    completed_unix_s REAL NOT NULL,
    max_duration_s REAL NOT NULL,
    -- JSON array of every rank's path, index = rank.
    paths_json TEXT NOT NULL,
    PRIMARY KEY (job, step)
);
CREATE TABLE IF NOT EXISTS incidents (
    id TEXT PRIMARY KEY,
    -- JSON array: the finding key that de-duplicates it.
    key_json TEXT NOT NULL,
    state TEXT NOT NULL,
    job TEXT NOT NULL,
    opened_unix_s REAL NOT NULL,
    latch_value REAL,
    -- The whole incident as a serialized clusterwatch.v1.Incident.
    incident BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS incidents_state ON incidents (state, opened_unix_s);
CREATE TABLE IF NOT EXISTS actions (
    id TEXT PRIMARY KEY,
    job TEXT NOT NULL,
    incident_id TEXT NOT NULL,
    decided_unix_s REAL NOT NULL,
    -- The whole record as a serialized clusterwatch.v1.ActionRecord.
    record BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS actions_job ON actions (job, decided_unix_s);
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

    def add_checkpoint(self, checkpoint: CompletedCheckpoint) -> None:
        with self._transaction():
            self._db.execute(
                "INSERT OR REPLACE INTO checkpoints (job, step, completed_unix_s, max_duration_s, paths_json) "
                "VALUES (?, ?, ?, ?, ?)",
                (checkpoint.job, checkpoint.step, checkpoint.completed_unix_s, checkpoint.max_duration_s,
                 json.dumps(checkpoint.paths)),
            )  # fmt: skip

    def latest_checkpoints(self, since_unix_s: float = 0.0) -> dict[str, LatestCheckpoint]:
        """The newest complete checkpoint of every job that completed one since ``since_unix_s``."""
        rows = self._db.execute(
            "SELECT c.job, c.step, c.completed_unix_s, c.max_duration_s FROM checkpoints c "
            "JOIN (SELECT job, MAX(step) AS step FROM checkpoints GROUP BY job) newest "
            "ON c.job = newest.job AND c.step = newest.step WHERE c.completed_unix_s >= ?",
            (since_unix_s,),
        ).fetchall()
        return {job: LatestCheckpoint(step, completed, duration) for job, step, completed, duration in rows}

    def checkpoint(self, job: str, step: int) -> CompletedCheckpoint | None:
        row = self._db.execute(
            "SELECT completed_unix_s, max_duration_s, paths_json FROM checkpoints WHERE job = ? AND step = ?",
            (job, step),
        ).fetchone()
        if row is None:
            return None
        return CompletedCheckpoint(job, step, row[0], tuple(json.loads(row[2])), row[1])

    def save_incidents(self, incidents: Iterable[Incident]) -> None:
        rows = [
            (i.id, json.dumps(i.key), i.state.value, i.job, i.opened_unix_s, i.latch_value,
             i.to_proto().SerializeToString())
            for i in incidents
        ]  # fmt: skip
        if not rows:
            return
        with self._transaction():
            self._db.executemany(
                "INSERT OR REPLACE INTO incidents (id, key_json, state, job, opened_unix_s, latch_value, incident) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                rows,
            )

    def incidents(self, include_resolved: bool = False, job: str = "", limit: int = 1000) -> list[Incident]:
        """The newest ``limit`` incidents, oldest first; only live ones unless ``include_resolved``."""
        query = "SELECT key_json, latch_value, incident FROM incidents WHERE 1 = 1"
        params: list[object] = []
        if not include_resolved:
            query += " AND state != ?"
            params.append(IncidentState.RESOLVED.value)
        if job:
            query += " AND job = ?"
            params.append(job)
        query += " ORDER BY opened_unix_s DESC, id DESC LIMIT ?"
        params.append(limit)
        rows = self._db.execute(query, params).fetchall()
        return [_incident(key_json, latch, blob) for key_json, latch, blob in reversed(rows)]

    def save_action(self, record: cluster_pb2.ActionRecord) -> None:
        with self._transaction():
            self._db.execute(
                "INSERT OR REPLACE INTO actions (id, job, incident_id, decided_unix_s, record) VALUES (?, ?, ?, ?, ?)",
                (
                    record.id,
                    record.job,
                    record.incident_id,
                    record.decided_unix_seconds,
                    record.SerializeToString(),
                ),
            )

    def actions(
        self, job: str = "", incident_id: str = "", limit: int = 1000
    ) -> list[cluster_pb2.ActionRecord]:
        """The newest ``limit`` action records, oldest first."""
        query = "SELECT record FROM actions WHERE 1 = 1"
        params: list[object] = []
        if job:
            query += " AND job = ?"
            params.append(job)
        if incident_id:
            query += " AND incident_id = ?"
            params.append(incident_id)
        query += " ORDER BY decided_unix_s DESC, rowid DESC LIMIT ?"
        params.append(limit)
        rows = self._db.execute(query, params).fetchall()
        return [cluster_pb2.ActionRecord.FromString(blob) for (blob,) in reversed(rows)]

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


def _incident(key_json: str, latch_value: float | None, blob: bytes) -> Incident:
    message = cluster_pb2.Incident.FromString(blob)
    return Incident(
        id=message.id, key=tuple(json.loads(key_json)), kind=Kind(message.kind), severity=Severity(message.severity),
        summary=message.summary, cause=message.cause, state=IncidentState.from_proto(message.state),
        opened_unix_s=message.opened_unix_seconds, updated_unix_s=message.updated_unix_seconds,
        job=message.job, ranks=tuple(message.ranks), nodes=tuple(message.nodes), gpus=tuple(message.gpus),
        evidence=dict(message.evidence), diagnoses=list(message.diagnoses),
        resolved_unix_s=message.resolved_unix_seconds, latch_value=latch_value,
    )  # fmt: skip
