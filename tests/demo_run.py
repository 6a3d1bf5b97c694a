"""One ``clusterwatch demo`` per mode for the whole session, watched by tests/e2e/test_demo.py and tests/deploy/test_dashboards.py.

The demo (two simulated nodes, an elastic torchrun job, a straggler and a hang, both
recovered) takes about a minute; both modules look at the same run instead of each
starting its own. test_demo checks how it ends; test_dashboards queries what a real
Prometheus scraped of it while it trained. Either may come first, so the run is watched
from its start whoever asks for it: a real Prometheus (where one is installed) scrapes its
coordinator, and one more node reports over the real agent protocol with what the demo
machine lacks (InfiniBand ports, one down; an XID; ECC errors; a rank that was killed).

With ``hardware_series="agents"`` (the session fixture ``lean_demo_run``) the demo's
coordinator runs in the large-cluster mode: its agents send report digests and serve the
hardware series on their own /metrics, which Prometheus scrapes as
deploy/prometheus/prometheus-agents.yml says; the extra node then sends digests too, once
asked, and serves its /metrics as an agent would. That run starts once the default one has
ended (``after``), so that the two never share the machine's two cores.

Imported as ``demo_run``; tests get the run from the session fixtures ``demo_run`` and
``lean_demo_run`` (tests/conftest.py). Prometheus is imported only to start it:
tests/e2e/test_demo.py does not need it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from helpers import clusterwatch_cmd, run_cli
from training_builders import EXITED, AgentStream, rank_report, step

from clusterwatch.cli.demo_training import DIR_ENV
from clusterwatch.client import ClusterClient
from clusterwatch.exposition.http_server import MetricsHttpServer
from clusterwatch.exposition.node_metrics import NODE_UP, register_node_families, write_node, write_node_info
from clusterwatch.exposition.promtext import Exposition
from clusterwatch.v1 import cluster_pb2, node_pb2, training_pb2
from clusterwatch.wire.report_digest import digest

if TYPE_CHECKING:
    from prometheus_server import PrometheusServer

FABRIC_NODE = "fabric-node"
FABRIC_JOB = "fabric-job"
BANNER_TIMEOUT_S = 90.0
FABRIC_REPORT_INTERVAL_S = 0.5
STATUS_TIMEOUT_S = 60.0
# Reports each demo node has sent when the snapshot is taken.
MIN_REPORTS = 5
STOP_TIMEOUT_S = 30.0


def demo_processes(within: Path) -> list[psutil.Process]:
    """Processes of demos whose temporary directory is under ``within``: its services (their
    state and sockets are there) and its training processes (they carry it in their environment)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.pid == os.getpid():
                continue
            workdir = process.environ().get(DIR_ENV)
            in_environment = workdir is not None and Path(workdir).is_relative_to(within)
            if in_environment or f"{within}{os.sep}" in " ".join(process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


class DemoRun:
    """``clusterwatch demo`` with its defaults (ports: any free), its summary in ``summary_path``.

    Args:
        workdir: the demo's log, summary and temporary directory (``tmpdir``), and Prometheus' data.
        hardware_series: the coordinator's mode (``--hardware-series``).
        after: start once this run's demo has ended (None: at once).
        coordinators: ``--coordinators`` (several: a group on etcd; no Prometheus is started).
    """

    def __init__(
        self,
        workdir: Path,
        hardware_series: str = "coordinator",
        after: DemoRun | None = None,
        coordinators: int = 1,
    ) -> None:
        self.hardware_series = hardware_series
        self.coordinators = coordinators
        self.log = workdir / "demo.log"
        self.summary_path = workdir / "summary.json"
        self.tmpdir = workdir / "t"  # short: the demo's agent sockets go in a directory under it
        self.tmpdir.mkdir()
        # test_dashboards skips or fails without Prometheus, and says why it did not start; test_demo needs none.
        self.prometheus: PrometheusServer | None = None
        self.prometheus_error: Exception | None = None
        if shutil.which("prometheus") and coordinators == 1:
            try:  # prometheus_server needs bench: the repository root on sys.path (python -m pytest)
                from prometheus_server import deployed_agent_job, start_prometheus

                agent_job = deployed_agent_job() if hardware_series == "agents" else None
                self.prometheus = start_prometheus(workdir / "prometheus", agent_job)
            except (ImportError, RuntimeError) as exc:
                self.prometheus_error = exc
        self.scraped_since_s: float | None = None
        self.status: subprocess.CompletedProcess[str] | None = None
        # The coordinator's full snapshot, taken while the demo ran (with both demo nodes in it).
        self.snapshot: cluster_pb2.ClusterSnapshot | None = None
        self.fabric_error: BaseException | None = None
        self._fabric_report: node_pb2.NodeReport | None = None
        self._closing = threading.Event()
        self._started = threading.Event()
        self.process: subprocess.Popen[bytes] | None = None
        self.log.touch()
        self._after = after
        if after is None:
            self._start()
        self._watcher = threading.Thread(target=self._watch, name="demo-run-watcher", daemon=True)
        self._watcher.start()

    def _start(self) -> None:
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                clusterwatch_cmd(
                    "demo",
                    "--listen",
                    "127.0.0.1:0",
                    "--metrics-listen",
                    "127.0.0.1:0",
                    "--summary-json",
                    str(self.summary_path),
                    "--hardware-series",
                    self.hardware_series,
                    "--coordinators",
                    str(self.coordinators),
                ),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "TMPDIR": str(self.tmpdir)},
            )
        self._started.set()

    def banner(self, key: str) -> str | None:
        """What follows ``key`` on the first line of the demo's output that has it."""
        line = next((ln for ln in self.log.read_text().splitlines() if key in ln), None)
        return line.split(key, 1)[1].strip() if line else None

    def endpoints(self, timeout_s: float = BANNER_TIMEOUT_S) -> tuple[str, str]:
        """The coordinator's gRPC address and /metrics URL, once the demo has printed them."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            address, url = self.banner("status --insecure --coordinator"), self.banner("metrics:")
            if address and url:
                return address, url
            if self.ended():
                raise AssertionError(
                    f"the demo exited ({self.process.returncode}) before it said where it listens:\n{self.tail()}"
                )
            time.sleep(0.2)
        raise AssertionError(
            f"timed out after {timeout_s} s waiting for the demo to say where it listens:\n{self.tail()}"
        )

    def ended(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def wait_started(self, timeout_s: float) -> bool:
        """Whether the demo has started (a run ``after`` another waits for that one's end)."""
        return self._started.wait(timeout_s)

    def wait(self, timeout_s: float) -> int:
        """The demo's exit status, once it has started and ended.

        Raises:
            subprocess.TimeoutExpired: not ended within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        if not self._started.wait(timeout_s):
            raise subprocess.TimeoutExpired("clusterwatch demo (not started yet)", timeout_s)
        assert self.process is not None
        return self.process.wait(max(0.0, deadline - time.monotonic()))

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        """Stop what is still running: the demo (if no test waited for its end), the fabric node, Prometheus.

        The demo gets Ctrl-C, as from a user: it stops its services and jobs (SIGTERM would end
        it at once and leave them running for the rest of the session).
        """
        self._closing.set()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        for leftover in demo_processes(self.tmpdir):
            with contextlib.suppress(psutil.Error):
                leftover.kill()
        self._watcher.join(timeout=STOP_TIMEOUT_S)
        if self.prometheus is not None:
            self.prometheus.close()

    def _watch(self) -> None:
        if self._after is not None:  # its end, or the session's: then there is nothing to wait for
            while not (self._after.ended() or self._closing.is_set()):
                time.sleep(0.2)
            if self._closing.is_set():
                return
            self._start()
        try:
            address, metrics_url = self.endpoints()
        except AssertionError:
            return  # the tests that ask for the endpoints say why
        fabric_metrics = None
        if self.hardware_series == "agents":  # the extra node serves its /metrics as an agent does
            fabric_metrics = MetricsHttpServer("127.0.0.1:0", self._fabric_page, lambda: True)
            fabric_metrics.start()
        if self.prometheus is not None:
            self.prometheus.scrape(metrics_url)
            agents = (self.banner("agents:") or "").split(" (")[0].split()
            if fabric_metrics is not None:
                self.prometheus.scrape_agents(*agents, f"http://127.0.0.1:{fabric_metrics.port}/metrics")
            self.scraped_since_s = time.time()
        threading.Thread(
            target=self._take_status, args=(address,), name="demo-run-status", daemon=True
        ).start()
        try:
            asyncio.run(self._feed_fabric_node(address))
        except Exception as exc:  # also when the demo ends: its coordinator stops under the stream
            self.fabric_error = exc  # shown by test_dashboards if its queries miss the fabric node
        finally:
            if fabric_metrics is not None:
                fabric_metrics.close()

    def _fabric_page(self) -> bytes:
        """The extra node's /metrics, rendered as an agent renders its own (agent/runtime.py)."""
        exp = Exposition()
        write_node_info(exp, FABRIC_NODE, FABRIC_NODE, "test", "")
        exp.add(NODE_UP, f'node="{FABRIC_NODE}"', 1)
        register_node_families(exp)
        report = self._fabric_report
        if report is not None:
            write_node(exp, FABRIC_NODE, report)
        return exp.render()

    def _take_status(self, address: str) -> None:
        """``clusterwatch status`` once it shows both demo nodes, while the demo runs (test_demo checks it)."""
        deadline = time.monotonic() + STATUS_TIMEOUT_S
        while not (self.ended() or self._closing.is_set()) and time.monotonic() < deadline:
            status = run_cli("status", "--insecure", "--coordinator", address)
            if all(f"demo-node-{n}" in status.stdout for n in (0, 1)):  # the agents connect in any order
                self.status = status
                self._take_snapshot(address, deadline)
                return
            time.sleep(0.2)

    def _take_snapshot(self, address: str, deadline: float) -> None:
        """The coordinator's full snapshot once both demo nodes sent a few reports (the first ones
        of a stream may come before the agent hears what the coordinator asks for)."""
        with ClusterClient(address) as client:
            while not (self.ended() or self._closing.is_set()) and time.monotonic() < deadline:
                snapshot = client.snapshot()
                demo_nodes = [n for n in snapshot.nodes if n.node_id.startswith("demo-node-")]
                if len(demo_nodes) == 2 and all(n.report.sequence >= MIN_REPORTS for n in demo_nodes):
                    self.snapshot = snapshot
                    return
                time.sleep(0.2)

    async def _feed_fabric_node(self, address: str) -> None:
        """One node over the real agent protocol; its job's rank 1 is killed by SIGKILL."""
        killed = training_pb2.RankExit(
            timestamp_unix_seconds=time.time(), signal=9, description="killed by signal 9"
        )
        async with AgentStream(address, FABRIC_NODE) as node:
            beats = 0
            # Until the demo prints its summary: then it stops its coordinator, the stream with it.
            while not (self.ended() or self._closing.is_set() or self.banner("summary:") is not None):
                beats += 1
                ranks = [rank_report(0, job=FABRIC_JOB, steps=[step(beats)])]
                if beats > 3:  # a clean start, then the failure
                    ranks.append(rank_report(1, job=FABRIC_JOB, state=EXITED, exit=killed))
                hardware = self._fabric_report = fabric_hardware(xids=0 if beats < 3 else 1)
                asked = any(m.report_settings.digest for m in node.messages if m.HasField("report_settings"))
                await node.report(*ranks, hardware=digest(hardware) if asked else hardware)
                await asyncio.sleep(FABRIC_REPORT_INTERVAL_S)


def fabric_hardware(xids: int) -> node_pb2.NodeReport:
    """What the demo's machine lacks: InfiniBand ports (one down), an XID, ECC errors."""
    report = node_pb2.NodeReport()
    report.gpus.add(
        index=0,
        uuid="GPU-fabric-0",
        name="NVIDIA H100 80GB HBM3",
        utilization_ratio=0.9,
        memory_used_bytes=60 << 30,
        memory_total_bytes=80 << 30,
        temperature_celsius=71.0,
        power_watts=500.0,
        power_limit_watts=700.0,
        sm_clock_hertz=1.98e9,
        sm_clock_max_hertz=1.98e9,
        ecc_corrected_errors_total=3,
        ecc_uncorrected_errors_total=0,
    )
    report.gpus[0].xid_errors.add(xid=79, count=xids)
    for port, up in ((0, True), (1, False)):
        report.ib_ports.add(
            device=f"mlx5_{port}",
            port=1,
            receive_bytes_total=10**12,
            transmit_bytes_total=10**12,
            transmit_wait_total=10**6,
            symbol_errors_total=0,
            link_downed_total=0 if up else 1,
            receive_errors_total=0,
            state="ACTIVE" if up else "DOWN",
            physical_state="LinkUp" if up else "Disabled",
            rate_bytes_per_second=50e9,
            link_layer="InfiniBand",
        )
    return report
