"""Durable history: node events, the node registry, complete checkpoints, incidents and actions, in SQLite (WAL).

One module of about 480 lines: every table shares one connection, one
transaction per batch and one queue of the writes an outage held back, so a
split by table would have to share the queue's internals.

Writes are small and rare (state transitions and checkpoint completions, not
reports), so they run synchronously on the caller's thread in one
transaction per batch.

When the database cannot be written (disk full, an I/O error, a read-only
state directory), the coordinator goes on serving from memory: a failed write
is queued instead of raised, one line is logged at error level for the whole
outage (the rest at debug), and the queue is retried every
``retry_interval_s`` (by the next write, and by ``retry_pending``, which the
detection loop calls each round) until it goes in, in one transaction; a
warning says so, with the outage's length. The queue keeps ``max_pending``
writes, the oldest dropped (and counted) beyond; writes of the same row (an
incident saved round after round) replace each other in it, so only a long
outage with much happening fills it. Incidents and actions read back include
the queued ones (ListIncidents, ListActions keep answering); events do not, as
the database numbers them. ``health()`` says how it stands, for /metrics.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from clusterwatch.coordinator.model.checkpoints import CompletedCheckpoint, LatestCheckpoint
from clusterwatch.coordinator.model.incidents import Incident, IncidentState
from clusterwatch.coordinator.model.job_records import JobRecords, incident
from clusterwatch.coordinator.model.state import Event
from clusterwatch.v1 import cluster_pb2

# The name it had before the coordinator had rooms: tests and operators filter on it.
logger = logging.getLogger("clusterwatch.coordinator.event_log")

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


# Writes kept in memory while the database cannot be written (see the module docstring).
MAX_PENDING_WRITES = 10_000
RETRY_INTERVAL_S = 2.0
# Rows per table deleted in one transaction by prune_batch: a few milliseconds each.
PRUNE_BATCH_ROWS = 5_000

INSERT_EVENTS = "INSERT INTO events (timestamp_unix_s, kind, node_id, detail) VALUES (?, ?, ?, ?)"
UPSERT_NODE = (
    "INSERT INTO nodes (node_id, hostname, interval_s, first_seen_unix_s) VALUES (?, ?, ?, ?) "
    "ON CONFLICT (node_id) DO UPDATE SET hostname = excluded.hostname, interval_s = excluded.interval_s"
)
SAVE_CHECKPOINT = (
    "INSERT OR REPLACE INTO checkpoints (job, step, completed_unix_s, max_duration_s, paths_json) "
    "VALUES (?, ?, ?, ?, ?)"
)
SAVE_INCIDENT = (
    "INSERT OR REPLACE INTO incidents (id, key_json, state, job, opened_unix_s, latch_value, incident) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)
SAVE_ACTION = (
    "INSERT OR REPLACE INTO actions (id, job, incident_id, decided_unix_s, record) VALUES (?, ?, ?, ?, ?)"
)

Row = tuple[object, ...]


@dataclasses.dataclass(frozen=True)
class StateHealth:
    """How the database stands, for /metrics.

    Attributes:
        writable: the newest write (or retry) went in.
        write_failures_total: writes and retries that failed, since start.
        pending_writes: writes waiting in memory for the database.
        dropped_writes_total: queued writes dropped because the queue was full, since start.
        last_error: why the newest write failed ("" while writable).
        size_bytes: the database's files on disk (with its WAL).
        pruned_rows_total: rows deleted for being older than the retention, since start.
    """

    writable: bool
    write_failures_total: int
    pending_writes: int
    dropped_writes_total: int
    last_error: str
    size_bytes: int = 0
    pruned_rows_total: int = 0


@dataclasses.dataclass(frozen=True)
class _Write:
    """One statement with its rows, run as part of a transaction."""

    sql: str
    rows: Sequence[Row]


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
    """The coordinator's SQLite database in ``state_dir/clusterwatch.db``.

    Args:
        state_dir: where the database lives (created if missing).
        max_pending: writes kept in memory while the database cannot be written.
        retry_interval_s: how often those are retried.
        clock: monotonic seconds, for the retries.

    Raises:
        sqlite3.Error: the database cannot be opened (it needs room for its WAL
            files, and for its schema when new or older).
        RuntimeError: the database is from a newer clusterwatch.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        max_pending: int = MAX_PENDING_WRITES,
        retry_interval_s: float = RETRY_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / "clusterwatch.db"
        self._max_pending = max_pending
        self._retry_interval_s = retry_interval_s
        self._clock = clock
        # Queued writes, oldest first; a key names the row an upsert writes (events get a serial).
        self._pending: collections.OrderedDict[tuple[object, ...], _Write] = collections.OrderedDict()
        self._event_serial = itertools.count()
        self._writable = True
        self._write_failures_total = 0
        self._dropped_total = 0
        self._dropped_in_outage = 0
        self._pruned_total = 0
        self._last_error = ""
        self._outage_started_s = 0.0
        self._next_retry_s = 0.0
        self._closed = False
        # Called with a job's name after its incidents, actions or checkpoints were written: a
        # coordinator of a group keeps a copy in etcd (coordinator/group/job_state.py).
        self.job_listeners: list[Callable[[str], None]] = []
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.path} has schema {version}, newer than this clusterwatch ({SCHEMA_VERSION})"
            )
        # Opening needs some room (a WAL database creates its -wal and -shm files): a
        # coordinator cannot start on a full disk. Once open, failed writes are queued.
        self._db.executescript(SCHEMA)
        if version != SCHEMA_VERSION:
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def health(self) -> StateHealth:
        """How the database stands now (for /metrics)."""
        return StateHealth(
            writable=self._writable,
            write_failures_total=self._write_failures_total,
            pending_writes=len(self._pending),
            dropped_writes_total=self._dropped_total,
            last_error=self._last_error,
            size_bytes=self.size_bytes(),
            pruned_rows_total=self._pruned_total,
        )

    def size_bytes(self) -> int:
        """The database's files on disk: the database, its WAL and its shared-memory index."""
        total = 0
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(OSError):
                total += (self.path.parent / (self.path.name + suffix)).stat().st_size
        return total

    def prune_batch(self, before_unix_s: float, limit: int = PRUNE_BATCH_ROWS) -> int:
        """Delete up to ``limit`` rows of each table from before ``before_unix_s``; the rows deleted
        (call again while it returns any: small batches keep the caller's loop responsive).

        What goes: events; incidents resolved, and opened before it; actions decided before it;
        checkpoints completed before it, except each job's newest (a restart may need it). What
        stays: open incidents however old, the node registry. A database that cannot be written
        now is left for the next call.
        """
        if self._closed or self._pending:
            return 0
        resolved = IncidentState.RESOLVED.value
        statements = (
            "DELETE FROM events WHERE id IN (SELECT id FROM events WHERE timestamp_unix_s < ? LIMIT ?)",
            "DELETE FROM incidents WHERE id IN (SELECT id FROM incidents WHERE state = ? AND "
            "opened_unix_s < ? LIMIT ?)",
            "DELETE FROM actions WHERE id IN (SELECT id FROM actions WHERE decided_unix_s < ? LIMIT ?)",
            "DELETE FROM checkpoints WHERE rowid IN (SELECT c.rowid FROM checkpoints c JOIN (SELECT job, "
            "MAX(step) AS step FROM checkpoints GROUP BY job) newest ON c.job = newest.job "
            "WHERE c.step < newest.step AND c.completed_unix_s < ? LIMIT ?)",
        )
        deleted = 0
        try:
            with self._transaction():
                for sql in statements:
                    params = (
                        (resolved, before_unix_s, limit) if "state = ?" in sql else (before_unix_s, limit)
                    )
                    deleted += self._db.execute(sql, params).rowcount
        except sqlite3.ProgrammingError:
            raise
        except sqlite3.DatabaseError as exc:  # the next writes will say how the disk is; try later
            logger.warning("state database %s: pruning old rows failed: %s", self.path, exc)
            return 0
        self._pruned_total += deleted
        return deleted

    def retry_pending(self) -> bool:
        """Write the queued writes if a retry is due; True when none is left queued."""
        if not self._pending:
            return True
        if self._clock() < self._next_retry_s:
            return False
        count = len(self._pending)
        try:
            self._execute(self._pending.values())
        except sqlite3.ProgrammingError:
            raise
        except sqlite3.DatabaseError as exc:
            self._failed(exc)
            return False
        self._pending.clear()
        self._recovered(count)
        return True

    def append(self, events: Iterable[Event]) -> None:
        rows = [(e.timestamp_unix_s, e.kind.value, e.node_id, e.detail) for e in events]
        if rows:
            self._write([(("events", next(self._event_serial)), _Write(INSERT_EVENTS, rows))])

    def upsert_node(self, node_id: str, hostname: str, interval_s: float, now_unix_s: float) -> None:
        self._write(
            [(("nodes", node_id), _Write(UPSERT_NODE, [(node_id, hostname, interval_s, now_unix_s)]))]
        )

    def forget_node(self, node_id: str) -> None:
        """The node reports to another coordinator now: not restored here after a restart."""
        self._write([(("nodes", node_id), _Write("DELETE FROM nodes WHERE node_id = ?", [(node_id,)]))])

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
        row = (
            checkpoint.job,
            checkpoint.step,
            checkpoint.completed_unix_s,
            checkpoint.max_duration_s,
            json.dumps(checkpoint.paths),
        )
        self._write([(("checkpoints", checkpoint.job, checkpoint.step), _Write(SAVE_CHECKPOINT, [row]))])
        self._changed({checkpoint.job})

    def job_records(self, job: str, actions_since_unix_s: float) -> JobRecords:
        """What a new owner of ``job`` continues from (coordinator/model/job_records.py)."""
        newest = self._db.execute("SELECT MAX(step) FROM checkpoints WHERE job = ?", (job,)).fetchone()[0]
        return JobRecords(
            job,
            tuple(self.incidents(job=job)),
            tuple(a for a in self.actions(job=job) if a.decided_unix_seconds >= actions_since_unix_s),
            self.checkpoint(job, newest) if newest is not None else None,
        )

    def _changed(self, jobs: Iterable[str]) -> None:
        for job in jobs:
            for listener in self.job_listeners:
                listener(job)

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
            (
                i.id,
                json.dumps(i.key),
                i.state.value,
                i.job,
                i.opened_unix_s,
                i.latch_value,
                i.to_proto().SerializeToString(),
            )
            for i in incidents
        ]
        # One write per incident, so that saving it again replaces it in the queue.
        self._write([(("incidents", row[0]), _Write(SAVE_INCIDENT, [row])) for row in rows])
        self._changed({str(row[3]) for row in rows if row[3]})

    def incidents(self, include_resolved: bool = False, job: str = "", limit: int = 1000) -> list[Incident]:
        """The newest ``limit`` incidents, oldest first; only live ones unless ``include_resolved``.

        Queued incidents (the database cannot be written) are included.
        """
        stored = self._stored_incidents(include_resolved, job, limit)
        queued = [_queued_incident(row) for row in self._queued_rows(SAVE_INCIDENT)]
        if not queued:
            return stored
        # A queued save is newer than the stored row, and may have moved it out of the selection.
        merged = {i.id: i for i in stored} | {i.id: i for i in queued}
        selected = [i for i in merged.values() if (include_resolved or i.live) and (not job or i.job == job)]
        return sorted(selected, key=lambda i: (i.opened_unix_s, i.id))[-limit:] if limit > 0 else []

    def _stored_incidents(self, include_resolved: bool, job: str, limit: int) -> list[Incident]:
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
        row = (
            record.id,
            record.job,
            record.incident_id,
            record.decided_unix_seconds,
            record.SerializeToString(),
        )
        self._write([(("actions", record.id), _Write(SAVE_ACTION, [row]))])
        self._changed({record.job})

    def actions(
        self, job: str = "", incident_id: str = "", limit: int = 1000
    ) -> list[cluster_pb2.ActionRecord]:
        """The newest ``limit`` action records, oldest first (queued ones included)."""
        stored = self._stored_actions(job, incident_id, limit)
        queued = [
            record
            for record in map(_queued_action, self._queued_rows(SAVE_ACTION))
            if (not job or record.job == job) and (not incident_id or record.incident_id == incident_id)
        ]
        if not queued:
            return stored
        merged = {a.id: a for a in stored} | {a.id: a for a in queued}
        # sorted() is stable: records decided at the same time keep the database's order.
        return sorted(merged.values(), key=lambda a: a.decided_unix_seconds)[-limit:] if limit > 0 else []

    def _stored_actions(self, job: str, incident_id: str, limit: int) -> list[cluster_pb2.ActionRecord]:
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
        """Close the database after a last try at the queued writes (what still fails is logged as lost)."""
        if self._pending:
            self._next_retry_s = 0.0
            if not self.retry_pending():
                logger.error(
                    "state database %s: %d queued write(s) lost at shutdown: %s",
                    self.path,
                    len(self._pending),
                    self._last_error,
                )
            self._pending.clear()
        self._closed = True
        self._db.close()

    def _write(self, writes: list[tuple[tuple[object, ...], _Write]]) -> None:
        """Run ``writes`` in one transaction, or queue them if the database cannot take them."""
        if self._closed:  # shutting down: a stream that ends after the database closed
            logger.info("state database %s is closed: %d late write(s) not made", self.path, len(writes))
            return
        if self._pending:  # behind the queue, in order; tried with it when a retry is due
            for key, write in writes:
                self._queue(key, write)
            self.retry_pending()
            return
        try:
            self._execute(write for _, write in writes)
        except sqlite3.ProgrammingError:
            raise  # our bug (or a closed database), not the disk's
        except sqlite3.DatabaseError as exc:
            self._failed(exc)
            for key, write in writes:
                self._queue(key, write)

    def _execute(self, writes: Iterable[_Write]) -> None:
        with self._transaction():
            for write in writes:
                self._db.executemany(write.sql, write.rows)

    def _queue(self, key: tuple[object, ...], write: _Write) -> None:
        self._pending.pop(key, None)
        self._pending[key] = write
        if len(self._pending) > self._max_pending:
            self._pending.popitem(last=False)
            self._dropped_total += 1
            self._dropped_in_outage += 1
            if self._dropped_in_outage == 1:
                logger.error(
                    "state database %s: %d writes queued, the most kept; dropping the oldest from now on "
                    "(the history of this outage will have gaps)",
                    self.path,
                    self._max_pending,
                )

    def _failed(self, exc: sqlite3.Error) -> None:
        now = self._clock()
        self._write_failures_total += 1
        self._last_error = str(exc) or type(exc).__name__
        self._next_retry_s = now + self._retry_interval_s
        if not self._writable:
            logger.debug("state database %s still cannot be written: %s", self.path, self._last_error)
            return
        self._writable = False
        self._outage_started_s = now
        logger.error(
            "cannot write the state database %s (%s): serving from memory; writes are queued (at most %d) "
            "and retried every %g s",
            self.path,
            self._last_error,
            self._max_pending,
            self._retry_interval_s,
        )

    def _recovered(self, written: int) -> None:
        dropped = f", {self._dropped_in_outage} dropped" if self._dropped_in_outage else ""
        logger.warning(
            "state database %s can be written again after %.1f s: %d queued write(s) caught up%s",
            self.path,
            self._clock() - self._outage_started_s,
            written,
            dropped,
        )
        self._writable = True
        self._last_error = ""
        self._dropped_in_outage = 0

    def _queued_rows(self, sql: str) -> list[Row]:
        return [row for write in self._pending.values() if write.sql == sql for row in write.rows]

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        # isolation_level=None leaves transactions to us: one per batch.
        self._db.execute("BEGIN")
        try:
            yield
        except BaseException:
            if self._db.in_transaction:  # SQLite rolls back by itself after some errors (disk full)
                self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")


def _queued_incident(row: Row) -> Incident:
    """The incident a queued SAVE_INCIDENT row writes."""
    key_json, latch_value, blob = row[1], row[5], row[6]
    assert isinstance(key_json, str)  # noqa: S101 - rows are built by save_incidents
    assert isinstance(blob, bytes)  # noqa: S101
    return _incident(key_json, float(latch_value) if isinstance(latch_value, int | float) else None, blob)


def _queued_action(row: Row) -> cluster_pb2.ActionRecord:
    """The action record a queued SAVE_ACTION row writes."""
    blob = row[4]
    assert isinstance(blob, bytes)  # noqa: S101 - rows are built by save_action
    return cluster_pb2.ActionRecord.FromString(blob)


def _incident(key_json: str, latch_value: float | None, blob: bytes) -> Incident:
    return incident(tuple(json.loads(key_json)), latch_value, blob)
