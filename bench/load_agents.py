"""One load-generator process of bench/load.py: thousands of simulated agents on a few connections.

Every agent opens one AgentService.Connect stream (bench/h2_client.py),
sends a hello, then one report per interval at a fixed phase, so the agents
of all processes together spread their reports evenly over the interval.
Streams open one after another over the ramp (a cluster's agents do not all
connect in the same millisecond). A report is skipped, and counted, when
the agent already has ``window`` reports unacknowledged (the coordinator is
behind: a real agent's replay buffer would be filling) or when this process
itself fell more than one interval behind its schedule (the generator is
behind: then the figures say more about this machine than about the
coordinator). As the agent's uplink does, reports start once the
coordinator answered the hello (it acknowledges an admitted stream at once),
and a stream the coordinator ends is reopened after the retry delay it gave
(RESOURCE_EXHAUSTED at capacity: ``grpc-retry-pushback-ms``, with the
uplink's jitter) or else the uplink's backoff (full jitter, capped at its
RECONNECT_MAX_S), the hello carrying the last acknowledged sequence;
unacknowledged reports are not replayed (the coordinator counts the gap as
missed).

Each report is built by bench.synthetic.StampedReport: constant bytes plus
a fresh sequence, timestamp (the moment it is handed to the stream: what the
send-to-visible latency is measured from), heartbeat and finished steps. The
steps of round r (the r-th interval since the common start) are numbered
r*steps+1 .. (r+1)*steps on every node, so the ranks of a job advance
together and no detector sees a hang or a straggler.

The process sends its counters to the parent every second (WorkerStats).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import heapq
import multiprocessing.queues
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import grpc

from bench.h2_client import H2Connection
from bench.synthetic import StampedReport, hello, node_report, rank_reports
from clusterwatch.agent.uplink import BUSY_RECONNECT_MAX_S, RECONNECT_MAX_S
from clusterwatch.runtime.backoff import Backoff
from clusterwatch.v1 import agent_pb2, node_pb2
from clusterwatch.wire import report_digest
from clusterwatch.wire.grpc_status import PUSHBACK_JITTER_FACTOR, retry_pushback_s

CONNECT = "/clusterwatch.v1.AgentService/Connect"
# Distinct node bodies per process (GPU UUIDs, serials); nodes share them round robin.
NODE_VARIANTS = 8
STATS_PERIOD_S = 1.0
# A report sent later than this after its due time counts as late (the generator lagged).
LATE_S = 0.1
FIRST_CLOSES = 10
AGE_BUCKETS_S = (1.0, 10.0, 29.0, 31.0, 60.0)


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What one generator process simulates.

    Attributes:
        worker: this process's number.
        host / port: the coordinator's gRPC address.
        agents: global indices of this process's agents.
        total_agents: agents over all processes (phases are spread over all of them).
        gpus / ranks / steps: per node: GPUs, training ranks, steps per rank per report.
        job_nodes: nodes per job (node i is in job i // job_nodes).
        interval_s: seconds between two reports of one agent.
        window: unacknowledged reports after which an agent skips reports.
        streams_per_connection: Connect streams per TCP connection.
        ramp_s: streams open evenly over this long after the start.
        tick_s: scheduler period (sends are batched per tick and connection).
        digest: send report digests (coordinator.hardware_series = "agents"), as real agents
            do when that coordinator asks; the generator does not wait to be asked.
    """

    worker: int
    host: str
    port: int
    agents: tuple[int, ...]
    total_agents: int
    gpus: int
    ranks: int
    steps: int
    job_nodes: int
    interval_s: float
    window: int
    streams_per_connection: int
    ramp_s: float
    tick_s: float
    digest: bool = False


@dataclasses.dataclass
class WorkerStats:
    """Counters of one generator process, sent to the parent as a dict every second."""

    worker: int
    time_unix_s: float = 0.0
    streams_opened: int = 0
    streams_closed: int = 0
    # Streams the coordinator refused with a retry delay (RESOURCE_EXHAUSTED at capacity).
    refused: int = 0
    # Reports not sent because the agent's stream was not admitted yet.
    skipped_not_admitted: int = 0
    sent: int = 0
    skipped_window: int = 0
    skipped_late: int = 0
    late: int = 0
    max_lateness_s: float = 0.0
    acks: int = 0
    commands: int = 0
    unacked_now_max: int = 0
    pending_bytes: int = 0
    sent_bytes: int = 0
    close_reasons: Counter[str] = dataclasses.field(default_factory=Counter)
    # The first few streams the coordinator ended: (unix s, node, sequence sent, sequence acknowledged, age s).
    first_closes: list[tuple[float, str, int, int, float]] = dataclasses.field(default_factory=list)
    # How long the streams the coordinator ended had been open.
    closed_stream_ages: Counter[str] = dataclasses.field(default_factory=Counter)
    goaways: int = 0
    reconnects: int = 0
    done: bool = False


def node_id(index: int) -> str:
    return f"load-{index:05d}"


def job_of(index: int, job_nodes: int) -> str:
    return f"load-job-{index // job_nodes:04d}"


class Agent:
    """One simulated agent: its stream, its sequence and what the coordinator acknowledged."""

    __slots__ = (
        "acked",
        "backoff",
        "busy_backoff",
        "conn",
        "connect_s",
        "name",
        "open",
        "opened_mono_s",
        "phase_s",
        "ranks_by_job",
        "retries",
        "sequence",
        "stats",
        "stream_acked",
        "stream_id",
        "template",
    )

    def __init__(
        self,
        name: str,
        phase_s: float,
        connect_s: float,
        template: StampedReport,
        stats: WorkerStats,
        *,
        retries: list[tuple[float, str, Agent]] | None = None,
        ranks_by_job: dict[str, int] | None = None,
    ) -> None:
        """``retries``: where a closed stream schedules its reconnect (a heap); None: no reconnects.
        ``ranks_by_job``: what its hello says its reports carry (a group of coordinators homes it by it)."""
        self.name = name
        self.ranks_by_job = ranks_by_job or {}
        self.retries = retries
        self.backoff = Backoff(cap_s=RECONNECT_MAX_S)
        self.busy_backoff = Backoff(base_s=1.0, cap_s=BUSY_RECONNECT_MAX_S)
        self.phase_s = phase_s
        self.connect_s = connect_s
        self.template = template
        self.stats = stats
        self.conn: H2Connection | None = None
        self.stream_id = 0
        self.sequence = 0
        self.acked = 0
        self.open = False
        self.opened_mono_s = 0.0
        self.stream_acked = False  # the coordinator has answered this stream's hello

    def connect(self, conn: H2Connection, interval_s: float) -> None:
        """Open a stream and say hello (again, after a reconnect: with what was acknowledged)."""
        greeting = hello(self.name, instance_id=self.name)
        greeting.interval_seconds = interval_s
        greeting.last_acked_sequence = self.acked
        greeting.ranks_by_job.update(self.ranks_by_job)
        self.conn = conn
        self.opened_mono_s = time.monotonic()
        self.stream_acked = False
        self.stream_id = conn.open_stream(self)
        self.open = conn.send(self.stream_id, agent_pb2.AgentMessage(hello=greeting).SerializeToString())
        self.stats.streams_opened += 1

    def report(self, window: int, first_step: int, steps: int) -> float | None:
        """Queue the next report (the caller flushes the connection); its timestamp, or None if skipped."""
        assert self.conn is not None
        if not self.stream_acked:  # like the agent's uplink: reports only once the stream was admitted
            self.stats.skipped_not_admitted += 1
            return None
        if self.sequence - self.acked >= window:
            self.stats.skipped_window += 1
            return None
        self.sequence += 1
        timestamp = time.time()
        message = self.template.message(self.sequence, timestamp, first_step, steps)
        if not self.conn.send(self.stream_id, message):
            return None
        self.stats.sent += 1
        self.stats.sent_bytes += len(message)
        return timestamp

    # StreamHandler
    def message_received(self, message: bytes) -> None:
        if message[:1] == b"\x0a":  # CoordinatorMessage.ack (1): Ack.sequence (1) inside
            inner, _ = _varint_at(message, 1)
            sequence = _varint_at(message, 3)[0] if inner and message[2] == 0x08 else 0
            self.acked = max(self.acked, sequence)
            self.stats.acks += 1
            self.stream_acked = True
            self.backoff.reset()
            self.busy_backoff.reset()
        elif message[:1] == b"\x12":  # a command: not answered, but counted (the bench expects none)
            self.stats.commands += 1

    def stream_closed(self, reason: str, trailers: Mapping[str, str]) -> None:
        if self.open:
            self.open = False
            self.stats.streams_closed += 1
            age_s = time.monotonic() - self.opened_mono_s
            self.stats.close_reasons[reason[:80]] += 1
            bucket = next((f"<{b:g} s" for b in AGE_BUCKETS_S if age_s < b), f">={AGE_BUCKETS_S[-1]:g} s")
            self.stats.closed_stream_ages[
                f"{bucket} {'after' if self.stream_acked else 'before'} an ack"
            ] += 1
            if len(self.stats.first_closes) < FIRST_CLOSES:
                self.stats.first_closes.append(
                    (time.time(), self.name, self.sequence, self.acked, round(age_s, 2))
                )
            pushback_s = retry_pushback_s(trailers.items())
            if pushback_s is not None:
                self.stats.refused += 1
            if (
                self.retries is not None
            ):  # like the agent's uplink: the delay asked for, else a jittered backoff
                if pushback_s is not None:
                    delay_s = self.backoff.pushed_back_s(pushback_s, PUSHBACK_JITTER_FACTOR)
                elif (
                    trailers.get("grpc-status") == str(grpc.StatusCode.CANCELLED.value[0])
                    and not self.stream_acked
                ):
                    delay_s = self.busy_backoff.next_delay_s()  # cancelled unread, as the uplink does
                else:
                    delay_s = self.backoff.next_delay_s()
                heapq.heappush(self.retries, (time.monotonic() + delay_s, self.name, self))


def _varint_at(data: bytes, offset: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, offset
        shift += 7


def node_template(
    name: str,
    body: node_pb2.NodeReport,
    *,
    ranks: int,
    steps: int,
    step_s: float,
    job: str,
    index_in_job: int,
    job_nodes: int,
) -> StampedReport:
    """The report template of node ``name``: ``body`` plus ``ranks`` ranks of ``job`` (node
    ``index_in_job`` of ``job_nodes``), each with ``steps`` steps per report."""
    rank_list = []
    if ranks:
        rank_list = rank_reports(index_in_job, ranks, steps, job=job, world_size=job_nodes * ranks)
        for rank in rank_list:
            rank.identity.hostname = name
            rank.identity.instance_id = f"{job}-{rank.identity.rank}"
    return StampedReport(body, rank_list, step_s)


def node_bodies(prefix: str, gpus: int, interval_s: float, digest: bool = False) -> list[node_pb2.NodeReport]:
    """NODE_VARIANTS node reports without ranks (nodes share them round robin); their digests
    with ``digest``."""
    bodies = [node_report(f"{prefix}-v{k}", gpus=gpus) for k in range(NODE_VARIANTS)]
    if digest:
        bodies = [report_digest.digest(body) for body in bodies]
    for body in bodies:
        body.interval_seconds = interval_s
    return bodies


def build_agents(
    spec: WorkerSpec, stats: WorkerStats, retries: list[tuple[float, str, Agent]]
) -> list[Agent]:
    """The process's agents with their report templates, sorted by phase; closed streams go to ``retries``."""
    bodies = node_bodies(node_id(spec.agents[0]), spec.gpus, spec.interval_s, spec.digest)
    step_s = spec.interval_s / max(1, spec.steps)
    agents = []
    for position, index in enumerate(spec.agents):
        job_start = index - index % spec.job_nodes
        template = node_template(
            node_id(index),
            bodies[position % NODE_VARIANTS],
            ranks=spec.ranks,
            steps=spec.steps,
            step_s=step_s,
            job=job_of(index, spec.job_nodes),
            index_in_job=index - job_start,
            job_nodes=min(spec.job_nodes, spec.total_agents - job_start),
        )
        fraction = index / spec.total_agents
        agents.append(
            Agent(
                node_id(index),
                fraction * spec.interval_s,
                fraction * spec.ramp_s,
                template,
                stats,
                retries=retries,
                ranks_by_job={job_of(index, spec.job_nodes): spec.ranks} if spec.ranks else None,
            )
        )
    return agents


class Scheduler:
    """Opens the agents' streams over the ramp and sends every report due, in phase order, round after round."""

    def __init__(
        self,
        spec: WorkerSpec,
        agents: list[Agent],
        stats: WorkerStats,
        retries: list[tuple[float, str, Agent]],
        start_mono: float,
    ) -> None:
        self._spec = spec
        self._agents = agents
        self._retries = retries
        self._stats = stats
        self._start_mono = start_mono
        self.connections: list[H2Connection] = []
        self._connected = self._due_index = self._round = 0

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        spec = self._spec
        authority = f"{spec.host}:{spec.port}"
        for _ in range(-(-len(self._agents) // spec.streams_per_connection)):
            _, protocol = await loop.create_connection(
                lambda: H2Connection(authority, CONNECT), spec.host, spec.port
            )
            self.connections.append(protocol)

    def tick(self, now: float) -> None:
        agents, spec, stats = self._agents, self._spec, self._stats
        while self._connected < len(agents) and self._start_mono + agents[self._connected].connect_s <= now:
            connection = self.connections[self._connected % len(self.connections)]
            agents[self._connected].connect(connection, spec.interval_s)
            self._connected += 1
        while self._retries and self._retries[0][0] <= now:
            _, _, agent = heapq.heappop(self._retries)
            if agent.conn is not None and not agent.conn.closed.done():
                agent.connect(agent.conn, spec.interval_s)
                stats.reconnects += 1
        while True:
            agent = agents[self._due_index]
            due = self._start_mono + agent.phase_s + self._round * spec.interval_s
            if due > now:
                break
            if agent.open:
                lateness = now - due
                if lateness > spec.interval_s:
                    stats.skipped_late += 1
                else:
                    agent.report(spec.window, self._round * spec.steps + 1, spec.steps)
                    stats.late += lateness > LATE_S
                    stats.max_lateness_s = max(stats.max_lateness_s, lateness)
            self._due_index += 1
            if self._due_index == len(agents):
                self._due_index, self._round = 0, self._round + 1
        for connection in self.connections:
            connection.flush()

    async def close(self) -> None:
        """Half-close every open stream (the agents leave), then the connections."""
        for agent in self._agents:
            if agent.open and agent.conn is not None:
                agent.conn.end_stream(agent.stream_id)
        for connection in self.connections:
            connection.flush()
        await asyncio.sleep(0.5)
        for connection in self.connections:
            connection.close()


async def run(
    spec: WorkerSpec,
    agents: list[Agent],
    stats: WorkerStats,
    retries: list[tuple[float, str, Agent]],
    *,
    window_unix_s: tuple[float, float],
    report: Any,
) -> None:
    """Run ``agents`` from the start to the stop of ``window_unix_s``; ``report(dict)`` every second."""
    start_mono = time.monotonic() + (window_unix_s[0] - time.time())
    stop_mono = time.monotonic() + (window_unix_s[1] - time.time())
    scheduler = Scheduler(spec, agents, stats, retries, start_mono)
    await scheduler.connect()
    await asyncio.sleep(max(0.0, start_mono - time.monotonic()))
    next_stats = time.monotonic()
    while (now := time.monotonic()) < stop_mono:
        scheduler.tick(now)
        if now >= next_stats:
            next_stats += STATS_PERIOD_S
            report(_snapshot(stats, agents, scheduler.connections))
        await asyncio.sleep(spec.tick_s)
    await scheduler.close()
    stats.done = True
    report(_snapshot(stats, agents, scheduler.connections))


def _snapshot(stats: WorkerStats, agents: list[Agent], connections: list[H2Connection]) -> dict[str, Any]:
    stats.time_unix_s = time.time()
    stats.unacked_now_max = max((a.sequence - a.acked for a in agents if a.open), default=0)
    stats.pending_bytes = sum(c.pending_bytes for c in connections)
    stats.goaways = sum(c.goaway for c in connections)
    out = dataclasses.asdict(stats)
    out["close_reasons"] = dict(stats.close_reasons)
    out["closed_stream_ages"] = dict(stats.closed_stream_ages)
    return out


def worker_main(
    spec: WorkerSpec, control: multiprocessing.queues.Queue[float], results: multiprocessing.queues.Queue[Any]
) -> None:
    """Process entry point: build the agents, say ready, wait for (start, stop) wall-clock times, run."""
    stats = WorkerStats(spec.worker)
    retries: list[tuple[float, str, Agent]] = []
    agents = build_agents(spec, stats, retries)
    gc.freeze()  # the templates live for the whole run: keep them out of every collection
    results.put({"worker": spec.worker, "ready": True})
    start_unix_s = control.get()
    stop_unix_s = control.get()
    asyncio.run(
        run(spec, agents, stats, retries, window_unix_s=(start_unix_s, stop_unix_s), report=results.put)
    )
