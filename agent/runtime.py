"""The agent process: collect on a fixed schedule, discover the topology, buffer, stream, serve /metrics."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import socket
import time
import uuid
from pathlib import Path
from types import ModuleType

from clusterwatch import __version__
from clusterwatch.agent.collectors.base import Collector, CollectorRunner
from clusterwatch.agent.commands import CommandHandler
from clusterwatch.agent.gpu.backend import GpuBackend
from clusterwatch.agent.hook_links import HookLinks
from clusterwatch.agent.hook_server import HookServer
from clusterwatch.agent.probes.server import ProbeServer
from clusterwatch.agent.proc_exit import ProcessExitWatcher
from clusterwatch.agent.rank_interfaces import RankInterfaces
from clusterwatch.agent.ranks import RankRegistry, RankState
from clusterwatch.agent.report_buffer import ReportBuffer
from clusterwatch.agent.topology.watch import TopologyWatch
from clusterwatch.agent.uplink import Uplink
from clusterwatch.agent.worker_env import WorkerEnvBook
from clusterwatch.agent.workers import WorkerStopper
from clusterwatch.config import AgentSettings
from clusterwatch.exposition.http_server import MetricsHttpServer
from clusterwatch.exposition.node_metrics import (
    NODE_UP,
    register_node_families,
    write_node,
    write_node_info,
    write_topology,
)
from clusterwatch.exposition.promtext import Exposition, counter, escape, gauge, labels
from clusterwatch.exposition.web_config import load_web_config
from clusterwatch.runtime import sd_notify
from clusterwatch.runtime.tls import TlsFiles
from clusterwatch.v1 import agent_pb2, node_pb2
from clusterwatch.wire.worker_env import env_file_path

logger = logging.getLogger(__name__)

CAPABILITIES = ("report.v1", "command.ping")
# Only with the hook socket on: without it there is nobody to relay a checkpoint to,
# and no registered process to diagnose or stop.
HOOK_CAPABILITIES = ("hook.v1", "command.checkpoint", "command.diagnose", "command.stop_workers")

AGENT_CONNECTED = gauge(
    "clusterwatch_agent_connected", "1 while the agent's stream to the coordinator is up."
)
AGENT_BUFFERED = gauge("clusterwatch_agent_reports_buffered", "Reports waiting for the coordinator's ack.")
AGENT_CONNECTIONS = counter("clusterwatch_agent_connections_total", "Streams the agent established.")
AGENT_RANKS = gauge(
    "clusterwatch_agent_ranks", "Training processes registered with this agent's hook socket, by state."
)
AGENT_EXIT_WATCHER = gauge(
    "clusterwatch_agent_exit_watcher_info",
    "How the agent learns of training process exits: netlink (with exit codes) or psutil (polling).",
)
AGENT_EXIT_OVERRUNS = counter(
    "clusterwatch_agent_exit_watcher_overruns_total",
    "Times the kernel dropped process events before the agent read them (exits then show as unknown).",
)


def open_gpu(settings: AgentSettings, nvml: ModuleType | None = None) -> GpuBackend | None:
    """The GPU backend ``settings.gpu_backend`` names; None with the gpu collector off or no GPUs.

    Raises:
        GpuBackendError: ``gpu_backend = "nvml"`` and NVML does not initialise.
    """
    if "gpu" not in settings.collectors:
        return None
    from clusterwatch.agent.gpu.factory import open_gpu_backend

    return open_gpu_backend(settings.gpu_backend, settings.sim_gpus, settings.resolved_node_id, nvml)


def build_collectors(settings: AgentSettings, nvml: ModuleType | None = None) -> list[Collector]:
    """The collectors named in ``settings.collectors``, in that order (opens the GPU backend)."""
    return collectors_for(settings, open_gpu(settings, nvml))


def collectors_for(settings: AgentSettings, gpu_backend: GpuBackend | None) -> list[Collector]:
    """The collectors named in ``settings.collectors``, the gpu one reading ``gpu_backend``."""
    collectors: list[Collector] = []
    for name in settings.collectors:
        if name == "gpu":
            from clusterwatch.agent.collectors.gpu import GpuCollector

            pod_resources = None
            if settings.pod_resources_socket:
                from clusterwatch.agent.pod_resources import PodResources

                pod_resources = PodResources(Path(settings.pod_resources_socket))
            collectors.append(GpuCollector(gpu_backend, pod_resources))
        elif name == "host":
            from clusterwatch.agent.collectors.host import HostCollector

            collectors.append(HostCollector(proc_root=settings.proc_root))
        elif name == "network":
            from clusterwatch.agent.collectors.network import NetworkCollector

            collectors.append(NetworkCollector(proc_root=settings.proc_root, sys_root=settings.sys_root))
        elif name == "infiniband":
            from clusterwatch.agent.collectors.infiniband import InfinibandCollector

            collectors.append(InfinibandCollector(sys_root=settings.sys_root))
    return collectors


class Agent:
    """One node's agent.

    Args:
        settings: the agent's settings.
        collectors: what to run each interval (default: from settings).
        exit_watcher: how training process exits are noticed (default: netlink, else psutil).
        tls: certificate, key and CA for the stream to the coordinator; None: plaintext.
        nvml: the pynvml module the GPU backend uses (tests inject a fake); the
            real one when None. Only with ``collectors`` None.
        gpu_backend: with ``collectors`` given, the GPU backend topology
            discovery asks for GPUs and their links (None: no GPUs). Without
            ``collectors`` the backend is opened from ``settings`` and shared
            by the gpu collector and discovery.

    Raises:
        GpuBackendError: ``gpu_backend = "nvml"`` in settings and NVML does not initialise.
    """

    def __init__(
        self,
        settings: AgentSettings,
        collectors: list[Collector] | None = None,
        exit_watcher: ProcessExitWatcher | None = None,
        *,
        tls: TlsFiles | None = None,
        nvml: ModuleType | None = None,
        gpu_backend: GpuBackend | None = None,
    ) -> None:
        self.settings = settings
        self.node_id = settings.resolved_node_id
        self.hostname = socket.gethostname()
        self.instance_id = uuid.uuid4().hex
        self.buffer = ReportBuffer(max(1, math.ceil(settings.buffer_s / settings.interval_s)))
        if collectors is None:
            gpu_backend = open_gpu(settings, nvml)
            collectors = collectors_for(settings, gpu_backend)
        self._runner = CollectorRunner(collectors)
        self.topology = TopologyWatch(gpu_backend, settings.sys_root, settings.topology_interval_s)
        self.exit_watcher = exit_watcher or ProcessExitWatcher()
        self.ranks = RankRegistry(settings.max_steps_per_report, self.exit_watcher)
        self.hook_links = HookLinks()
        self.rank_interfaces = RankInterfaces()
        self.hook_server = (
            HookServer(Path(settings.socket), self.ranks, self.hook_links, group=settings.socket_group)
            if settings.socket
            else None
        )
        self.worker_env = WorkerEnvBook(Path(env_file_path(settings.socket))) if self.hook_server else None
        self.commands = CommandHandler(
            checkpoint_relay=self.hook_links if self.hook_server else None,
            process_lookup=self.ranks if self.hook_server else None,
            worker_lookup=self.ranks if self.hook_server else None,
            stopper=WorkerStopper(
                gpu_pids=self.gpu_pids_in_use, gpu_check_timeout_s=3 * settings.interval_s + 5.0
            ),
            worker_env=self.worker_env,
        )
        self.uplink = Uplink(
            settings.coordinator,
            self.hello,
            self.buffer,
            self.commands,
            settings.reconnect_max_s,
            on_checkpoints=self.hook_links.update_checkpoints,
            on_connection=self._tell_systemd_connection,
            credentials=tls.channel_credentials() if tls else None,
        )
        self._told_systemd_ready = False
        self.latest: node_pb2.NodeReport | None = None
        self._sequence = 0
        self._collections_started = 0
        self._collected = asyncio.Condition()  # notified after each report is collected
        self._http: MetricsHttpServer | None = None
        self.probe_server = ProbeServer(settings.probe_listen) if settings.probe_listen else None
        # Swapped whole after each report, so the /metrics thread never iterates the registry.
        self._rank_counts: dict[RankState, int] = dict.fromkeys(RankState, 0)

    @property
    def metrics_port(self) -> int | None:
        return self._http.port if self._http else None

    def hello(self, last_acked_sequence: int) -> agent_pb2.Hello:
        """The Hello that opens each stream: who we are, the topology as last discovered, and the jobs of
        the first report it will carry (where a group of coordinators homes the node)."""
        first = next(iter(self.buffer.after(last_acked_sequence)), None) or self.latest
        ranks_by_job = collections.Counter(r.identity.job for r in first.ranks) if first is not None else {}
        return agent_pb2.Hello(
            ranks_by_job=ranks_by_job,
            node_id=self.node_id,
            hostname=self.hostname,
            agent_version=__version__,
            instance_id=self.instance_id,
            capabilities=CAPABILITIES + (HOOK_CAPABILITIES if self.hook_server else ()),
            interval_seconds=self.settings.interval_s,
            last_acked_sequence=last_acked_sequence,
            topology=self.topology.current,
            probe_port=self.probe_server.port if self.probe_server else 0,
        )

    def _tell_systemd_connection(self, connected: bool) -> None:
        """READY=1 once the first report reached the coordinator; STATUS on every change.

        A no-op unless systemd started the agent (Type=notify sets NOTIFY_SOCKET).
        """
        target = self.uplink.target
        if not connected:
            sd_notify.notify(sd_notify.status(f"lost coordinator {target}; buffering reports, reconnecting"))
            return
        ready = () if self._told_systemd_ready else (sd_notify.READY,)
        self._told_systemd_ready = True
        sd_notify.notify(*ready, sd_notify.status(f"reporting to {target}"))

    def _collect(self) -> node_pb2.NodeReport:
        # Discovery first: the report collected right after a change carries it.
        self.topology.refresh_if_due()
        report = node_pb2.NodeReport(interval_seconds=self.settings.interval_s)
        self._runner.run(report)
        changed = self.topology.take_change()
        if changed is not None:
            report.topology.CopyFrom(changed)
        if self.worker_env is not None:
            report.worker_env.extend(self.worker_env.report())
        report.timestamp_unix_seconds = time.time()
        return report

    async def collect_once(self) -> node_pb2.NodeReport:
        """Collect one report (off the event loop: NVML calls can block) and buffer it.

        The ranks are added on the loop, which owns the registry.
        """
        self._collections_started += 1
        pids = [entry.pid for entry in self.ranks.entries() if entry.state is RankState.RUNNING]
        report = await asyncio.to_thread(self._collect)
        interfaces = await asyncio.to_thread(self.rank_interfaces.read, pids) if pids else {}
        self.ranks.report_into(report.ranks)
        for rank in report.ranks:
            rank.interfaces.extend(interfaces.get(rank.identity.pid, ()))
        self._rank_counts = self.ranks.count_by_state()
        self._sequence += 1
        report.sequence = self._sequence
        report.reports_dropped_total = self.buffer.dropped_total
        self.buffer.append(report)
        self.latest = report
        async with self._collected:
            self._collected.notify_all()
        return report

    async def gpu_pids_in_use(self) -> set[int] | None:
        """Pids holding GPU memory in the first report collected after this call; None: no GPUs here.

        Only NVML lists processes (simulated GPUs have none), so any other
        backend counts as no GPUs. Waits for the next collection to start and
        finish (about one interval); the caller bounds the wait.
        """
        if self.latest is not None and self.latest.gpu_inventory.backend != "nvml":
            return None
        wanted = self._collections_started + 1  # one that starts after now
        async with self._collected:
            await self._collected.wait_for(lambda: self._sequence >= wanted)
        report = self.latest
        if report is None or report.gpu_inventory.backend != "nvml":
            return None
        return {process.pid for gpu in report.gpus for process in gpu.processes}

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set, then close the stream and the collectors.

        Raises:
            HookSocketError: the hook socket is unusable or served by another agent
                (raised before anything else starts).
        """
        if self.hook_server is not None:
            self.exit_watcher.start()
            try:
                await self.hook_server.start()
            except BaseException:
                self.exit_watcher.close()
                raise
        try:
            await self._report_until(stop)
        finally:
            if self.hook_server is not None:
                await self.hook_server.stop()
                self.exit_watcher.close()

    async def _report_until(self, stop: asyncio.Event) -> None:
        if self.settings.metrics_listen:
            self._http = MetricsHttpServer(
                self.settings.metrics_listen,
                self.render_metrics,
                lambda: True,
                key="agent.metrics_listen",
                web=load_web_config(self.settings.web_config_file, "agent.web_config_file"),
            )
            self._http.start()
            logger.info("serving /metrics on port %d", self._http.port)
        self._start_probe_server()
        logger.info(
            "agent %s reporting to %s every %.3g s",
            self.node_id,
            self.settings.coordinator,
            self.settings.interval_s,
        )
        # Before the stream opens, so that the first Hello carries the topology.
        await asyncio.to_thread(self.topology.refresh_if_due)
        sd_notify.notify(sd_notify.status(f"connecting to coordinator {self.settings.coordinator}"))
        # Pinged from this loop, so a wedged loop stops the pings and systemd restarts us.
        watchdog = sd_notify.start_watchdog()
        uplink = asyncio.create_task(self.uplink.run(stop), name="uplink")
        try:
            next_due = time.monotonic()
            while not stop.is_set():
                await self.collect_once()
                next_due += self.settings.interval_s
                now = time.monotonic()
                if next_due < now:  # fell behind (e.g. a slow NVML call): skip, don't burst
                    next_due = now + self.settings.interval_s
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=next_due - now)
            sd_notify.notify(sd_notify.STOPPING, sd_notify.status("stopping"))
            await asyncio.wait_for(uplink, timeout=5.0)
        finally:
            await sd_notify.stop_watchdog(watchdog)
            uplink.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await uplink
            self._runner.close()
            if self._http:
                self._http.close()
            if self.probe_server:
                self.probe_server.close()

    def _start_probe_server(self) -> None:
        """Answer peers' probes; where its address cannot be bound the agent reports without it (the
        coordinator then says this node cannot be probed)."""
        if self.probe_server is None:
            return
        try:
            self.probe_server.start()
        except OSError as exc:
            logger.error("no probe server: agent.probe_listen %s: %s", self.settings.probe_listen, exc)
            self.probe_server = None

    def render_metrics(self) -> bytes:
        """This node's /metrics page (called from the HTTP thread; reads one reference)."""
        exp = Exposition()
        report = self.latest
        node = f'node="{escape(self.node_id)}"'
        backend = report.gpu_inventory.backend if report else ""
        write_node_info(exp, self.node_id, self.hostname, __version__, backend)
        exp.add(NODE_UP, node, 1)
        register_node_families(exp)
        if report is not None:
            write_node(exp, self.node_id, report, nvlink_per_link=self.settings.nvlink_series == "link")
        wiring = self.topology.wiring
        if wiring is not None:
            write_topology(exp, self.node_id, wiring)
        exp.add(AGENT_CONNECTED, node, int(self.uplink.connected))
        exp.add(AGENT_BUFFERED, node, len(self.buffer))
        exp.add(AGENT_CONNECTIONS, node, self.uplink.connections_total)
        if self.hook_server is not None:
            self.hook_server.stats.write(exp, node)
            for state, count in self._rank_counts.items():
                exp.add(AGENT_RANKS, f"{node},{labels(state=state.name.lower())}", count)
            exp.add(AGENT_EXIT_WATCHER, f"{node},{labels(method=self.exit_watcher.method)}", 1)
            exp.add(AGENT_EXIT_OVERRUNS, node, self.exit_watcher.overruns_total)
        return exp.render()
