"""What bench/load.py measures with, in its own process: probe agents, the API prober, the
/metrics scraper and the coordinator's RSS sampler (one thread each).

Send-to-visible latency is measured two ways from the same GetSnapshot(summary_only) polls:

* **Probe**: a few probe agents in this process (their own connection, same
  report template as the load) send a report when the prober asks; the
  prober then polls back to back until a snapshot shows that sequence. The
  latency lies between the send and the answer that shows it (upper bound)
  and is more than the send to the last poll sent that did not show it
  (lower bound); the bounds are one snapshot call apart.
* **Population**: for every node whose sequence advanced since the previous
  poll, the newest report's age when the answer arrived (its timestamp is
  when the agent handed it to its stream). An upper bound, coarser by up to
  one poll interval, but over every agent, including those whose
  connections the coordinator is behind on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import math
import threading
import time
import zlib

import psutil

from bench.h2_client import H2Connection
from bench.load_agents import CONNECT, Agent, WorkerStats, node_bodies, node_template
from clusterwatch.client import ClusterClient
from clusterwatch.v1 import cluster_pb2

UP = cluster_pb2.NodeState.NODE_STATE_UP
# A probe report not visible after this long is given up on (counted).
PROBE_TIMEOUT_S = 120.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


class ProbeAgents:
    """``count`` agents on one connection from this process, each reporting only when told to.

    Their nodes form one job of their own, with the same GPUs, ranks and steps as the load.
    """

    def __init__(
        self,
        host: str,
        port: int,
        count: int,
        *,
        gpus: int,
        ranks: int,
        steps: int,
        interval_s: float,
        digest: bool = False,
    ):
        self._host, self._port = host, port
        self._interval_s = interval_s
        self._steps = steps
        self.stats = WorkerStats(worker=-1)
        bodies = node_bodies("probe", gpus, interval_s, digest)
        self.agents = []
        for k in range(count):
            template = node_template(
                f"probe-{k}",
                bodies[k % len(bodies)],
                ranks=ranks,
                steps=steps,
                step_s=interval_s / max(1, steps),
                job="load-probe",
                index_in_job=k,
                job_nodes=count,
            )
            self.agents.append(Agent(f"probe-{k}", 0.0, 0.0, template, self.stats))
        self._reports = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="probe-agents", daemon=True)

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._connect(), self._loop).result(30)

    async def _connect(self) -> None:
        authority = f"{self._host}:{self._port}"
        _, self._connection = await self._loop.create_connection(
            lambda: H2Connection(authority, CONNECT), self._host, self._port
        )
        for agent in self.agents:
            agent.connect(self._connection, self._interval_s)
        self._connection.flush()

    def send(self, k: int) -> tuple[str, int, float] | None:
        """Agent ``k`` sends its next report now: (node id, sequence, send time), None if it could not."""
        return asyncio.run_coroutine_threadsafe(self._send(k), self._loop).result(30)

    async def _send(self, k: int) -> tuple[str, int, float] | None:
        agent = self.agents[k]
        self._reports += 1
        stamp = agent.report(window=1 << 30, first_step=self._reports * self._steps + 1, steps=self._steps)
        self._connection.flush()
        return None if stamp is None else (agent.name, agent.sequence, stamp)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._connection.close)
        self._loop.call_soon_threadsafe(self._loop.stop)


@dataclasses.dataclass
class Poll:
    sent_unix_s: float
    received_unix_s: float
    server_unix_s: float
    bytes: int
    nodes_up: int
    received_total: int
    incidents: int


class Prober(threading.Thread):
    """Sends a probe report every ``probe_period_s`` and polls GetSnapshot(summary_only) back to
    back until it shows; latencies of the reports sent in ``window``.

    A snapshot of N nodes costs the coordinator O(N + ranks) on its event loop, so
    polls happen only for probes: at 1,000 nodes x 8 ranks one is ~0.2 s of CPU.
    """

    def __init__(
        self,
        address: str,
        probes: ProbeAgents,
        *,
        probe_period_s: float,
        window: tuple[float, float],
        stop: threading.Event,
    ) -> None:
        super().__init__(name="prober", daemon=True)
        self._address = address
        self._probes = probes
        self._probe_period_s = probe_period_s
        self._window = window
        self._finish = stop
        self.polls: list[Poll] = []
        self.probe_upper_s: list[float] = []
        self.probe_lower_s: list[float] = []
        self.probes_lost = 0
        self.population_upper_s: list[float] = []
        self.errors: list[str] = []

    def run(self) -> None:
        begin, end = self._window
        last_sequence: dict[str, int] = {}
        pending: tuple[str, int, float] | None = None
        lower_s = 0.0
        next_probe = time.time()
        probes = 0
        with ClusterClient(self._address, timeout_s=PROBE_TIMEOUT_S) as client:
            while not self._finish.is_set():
                if pending is None and time.time() >= next_probe:
                    pending = self._probes.send(probes % len(self._probes.agents))
                    probes += 1
                    lower_s = 0.0
                    next_probe = max(next_probe + self._probe_period_s, time.time())
                sent = time.time()
                try:
                    snapshot = client.snapshot(summary_only=True)
                except Exception as exc:
                    self.errors.append(f"after {time.time() - sent:.1f} s: {exc}"[:300])
                    self._finish.wait(self._probe_period_s)
                    continue
                received = time.time()
                self._population(
                    snapshot, sent=sent, received=received, last_sequence=last_sequence, begin=begin, end=end
                )
                if pending is not None:
                    node, sequence, stamp = pending
                    if last_sequence.get(node, 0) >= sequence:
                        if begin <= stamp <= end:
                            self.probe_upper_s.append(received - stamp)
                            self.probe_lower_s.append(lower_s)
                        pending = None
                    elif received - stamp > PROBE_TIMEOUT_S:
                        self.probes_lost += begin <= stamp <= end
                        pending = None
                    else:
                        lower_s = max(lower_s, sent - stamp)
                        continue  # back to back until it shows
                self._finish.wait(max(0.0, next_probe - time.time()))

    def _population(
        self,
        snapshot: cluster_pb2.ClusterSnapshot,
        *,
        sent: float,
        received: float,
        last_sequence: dict[str, int],
        begin: float,
        end: float,
    ) -> None:
        up = total = 0
        for node in snapshot.nodes:
            total += node.reports_received_total
            up += node.state == UP
            sequence = node.last_sequence
            if sequence > last_sequence.get(node.node_id, 0):
                last_sequence[node.node_id] = sequence
                stamp = node.report.timestamp_unix_seconds
                if begin <= stamp <= end:
                    self.population_upper_s.append(received - stamp)
        self.polls.append(
            Poll(
                sent,
                received,
                snapshot.timestamp_unix_seconds,
                snapshot.ByteSize(),
                up,
                total,
                len(snapshot.incidents),
            )
        )


@dataclasses.dataclass
class Scrape:
    started_unix_s: float
    seconds: float
    status: int
    bytes: int
    samples: int | None


class Scraper(threading.Thread):
    """GET /metrics every interval, gzip-encoded as Prometheus asks; counts the samples of the
    first scrape that starts after ``count_after_unix_s`` (decompressing it costs this process)."""

    def __init__(
        self, port: int, interval_s: float, stop: threading.Event, count_after_unix_s: float
    ) -> None:
        super().__init__(name="scraper", daemon=True)
        self._port = port
        self._interval_s = interval_s
        self._finish = stop
        self._count_after_unix_s = count_after_unix_s
        self.scrapes: list[Scrape] = []
        self.errors: list[str] = []

    def run(self) -> None:
        while not self._finish.wait(self._interval_s):
            started = time.time()
            count = started >= self._count_after_unix_s and not any(s.samples for s in self.scrapes)
            try:
                self.scrapes.append(self._scrape(count=count))
            except Exception as exc:  # a failed scrape is a result
                self.errors.append(f"after {time.time() - started:.1f} s: {exc}"[:300])

    def _scrape(self, count: bool) -> Scrape:
        started, t0 = time.time(), time.monotonic()
        connection = http.client.HTTPConnection("127.0.0.1", self._port, timeout=300)
        try:
            connection.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
            response = connection.getresponse()
            size = lines = comments = 0
            decoder = zlib.decompressobj(16 + zlib.MAX_WBITS) if count and response.status == 200 else None
            while chunk := response.read(1 << 20):
                size += len(chunk)
                if decoder is not None:
                    text = decoder.decompress(chunk)
                    lines += text.count(b"\n")
                    comments += text.count(b"\n#")
            seconds = time.monotonic() - t0
        finally:
            connection.close()
        return Scrape(
            started, seconds, response.status, size, lines - comments if decoder is not None else None
        )


class Sampler(threading.Thread):
    """The coordinator's CPU time and RSS every second."""

    def __init__(self, pid: int, stop: threading.Event) -> None:
        super().__init__(name="sampler", daemon=True)
        self._process = psutil.Process(pid)
        self._finish = stop
        self.samples: list[tuple[float, float, int]] = []  # (unix s, cpu s, rss bytes)

    def run(self) -> None:
        while not self._finish.wait(1.0):
            with contextlib.suppress(psutil.Error):
                self.samples.append((time.time(), cpu_s(self._process), self._process.memory_info().rss))
