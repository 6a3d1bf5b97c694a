"""Runs the coordinator: gRPC API, health, reflection, /metrics, liveness.

The composition root: it builds the core and the watchdog (coordinator/wiring.py),
the recovery executor, the actions and the servicers, and wires them together.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from clusterwatch.config import CoordinatorSettings, DetectionSettings, RecoverySettings
from clusterwatch.coordinator.api.access import AccessPolicy, read_tokens
from clusterwatch.coordinator.api.agent_servicer import AgentServicer
from clusterwatch.coordinator.api.api_thread import ApiThread
from clusterwatch.coordinator.api.cluster_servicer import ClusterServicer, add_cluster_service
from clusterwatch.coordinator.api.cluster_views import LiveViews, RecentViews, ViewSource, take_views
from clusterwatch.coordinator.api.core_calls import CoreCalls
from clusterwatch.coordinator.api.errors_interceptor import ErrorMappingInterceptor
from clusterwatch.coordinator.group.homing import Homing
from clusterwatch.coordinator.group.membership import Member, Membership
from clusterwatch.coordinator.group_duties import GroupDuties
from clusterwatch.coordinator.metrics.incidents import IncidentView, incident_view
from clusterwatch.coordinator.metrics.load import GroupView, LoadView
from clusterwatch.coordinator.metrics.page import render
from clusterwatch.coordinator.metrics.recovery import RecoveryView, recovery_view
from clusterwatch.coordinator.model.event_log import EventLog, StateHealth
from clusterwatch.coordinator.model.retention import SECONDS_PER_DAY, keep_pruned
from clusterwatch.coordinator.recovery.actions import Actions
from clusterwatch.coordinator.recovery.avoidance import AvoidanceWatch
from clusterwatch.coordinator.recovery.executor import Recovery
from clusterwatch.coordinator.recovery.launchers import (
    Launcher,
    SendStop,
    VerifiedSlurmJobs,
    make_launcher,
    parse_slurm_job_ids,
)
from clusterwatch.coordinator.views.jobs import TrainingView, training_view
from clusterwatch.coordinator.views.nodes import NodeView, node_views
from clusterwatch.coordinator.wiring import build_core
from clusterwatch.errors import ClusterwatchError
from clusterwatch.exposition.http_server import MetricsHttpServer
from clusterwatch.exposition.web_config import load_web_config
from clusterwatch.runtime import sd_notify
from clusterwatch.runtime.etcd import Etcd
from clusterwatch.runtime.grpc_options import SERVER_OPTIONS
from clusterwatch.runtime.listen import add_grpc_port
from clusterwatch.runtime.peer_identity import PeerVerifier
from clusterwatch.runtime.tls import TlsFiles
from clusterwatch.v1 import agent_pb2, agent_pb2_grpc, cluster_pb2

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 2.0
RENDER_SNAPSHOT_TIMEOUT_S = 10.0
# The interpreter's switch interval with the API thread on (coordinator.api_listen); see start().
API_SWITCH_INTERVAL_S = 0.001
# The [recovery] settings the launcher is built from: fixed until the coordinator restarts.
LAUNCHER_FIELDS = (
    "launcher",
    "restart_grace_s",
    "slurm_job_ids",
    "scontrol",
    "kubernetes_namespace",
    "kubernetes_pod_selector",
    "kubectl",
)


def launcher_from(
    settings: RecoverySettings, send_stop: SendStop, verified_slurm_jobs: VerifiedSlurmJobs | None = None
) -> Launcher:
    """The launcher adapter ``settings`` choose, with their options for it.

    ``verified_slurm_jobs`` lets the SLURM adapter use the SLURM job verified for a job.

    Raises:
        ConfigError: a bad option of the chosen launcher, naming its key.
    """
    return make_launcher(
        settings.launcher,
        send_stop,
        stop_grace_s=settings.restart_grace_s,
        slurm_job_ids=parse_slurm_job_ids(settings.slurm_job_ids) if settings.launcher == "slurm" else None,
        verified_slurm_jobs=verified_slurm_jobs,
        scontrol=settings.scontrol,
        kubernetes_namespace=settings.kubernetes_namespace,
        kubernetes_pod_selector=settings.kubernetes_pod_selector,
        kubectl=settings.kubectl,
    )


@dataclasses.dataclass(frozen=True)
class MetricsPage:
    """What /metrics shows, copied on the event loop and rendered in the HTTP thread."""

    nodes: list[NodeView]
    training: TrainingView
    incidents: IncidentView
    recovery: RecoveryView
    reports_rejected: dict[tuple[str, str], int]
    state: StateHealth
    load: LoadView


class CoordinatorServer:
    """The coordinator process's servers around one Coordinator.

    Args:
        settings: listen addresses, state directory, liveness.
        detection: detection thresholds (defaults when None).
        recovery: the recovery policy and launcher (defaults when None).
        tls: serve mutual TLS with these files (None: plaintext); nodes must then
            report under a name their certificate carries.

    Raises:
        ConfigError: a bad option of the chosen launcher, or an unusable admin_token_file.
    """

    def __init__(
        self,
        settings: CoordinatorSettings,
        detection: DetectionSettings | None = None,
        recovery: RecoverySettings | None = None,
        *,
        tls: TlsFiles | None = None,
        etcd_tls: TlsFiles | None = None,
    ) -> None:
        self.settings = settings
        self._tls = tls
        self._etcd_tls = etcd_tls
        self.access = AccessPolicy(
            read_tokens(settings.admin_token_file),
            settings.admin_names,
            verifier=PeerVerifier(tls.ca) if tls is not None else None,
        )
        recovery = recovery or RecoverySettings()
        # Before anything is opened: it may raise. (self.core exists by the time a job's labels are asked for.)
        launcher = launcher_from(recovery, self._send_stop, self._verified_slurm_jobs)
        self.core, self.watchdog = build_core(
            EventLog(settings.state_dir),
            settings.unreachable_after_intervals,
            detection=detection,
            max_agent_streams=settings.max_agent_streams,
        )
        self.actions = Actions(self.core)
        self.recovery = Recovery(
            recovery,
            watchdog=self.watchdog,
            event_log=self.core.event_log,
            jobs=lambda: self.core.jobs.jobs,
            latest_checkpoint=self.core.checkpoints.latest_step,
            checkpoint_now=self.actions.checkpoint_now,
            launcher=launcher,
            wall_clock=time.time,
            send_stop=self._send_stop,
            fenced=self._fenced,
            nodes=lambda: self.core.state.nodes,
            send_command=self.core.send_command,
        )
        self.avoidance = AvoidanceWatch(
            self.core.send_command,
            nodes=lambda: self.core.state.nodes,
            jobs=lambda: self.core.jobs.jobs,
            hold_s=lambda: self.recovery.settings.avoid_interface_hold_s,
            recheck_s=lambda: self.recovery.settings.avoid_interface_recheck_s,
            wall_clock=time.time,
        )
        self.actions.recovery = self.recovery
        self.actions.avoidance = self.avoidance
        self.core.job_ended_listeners.append(self.recovery.forget_job)
        self.grpc_port = 0
        self.api_port: int | None = None
        self.metrics_port: int | None = None
        self._api: ApiThread | None = None
        # With coordinator.etcd: this coordinator's place in its group (made in start()).
        self.membership: Membership | None = None
        self.group: GroupDuties | None = None
        self.homing: Homing | None = None
        self._server: grpc.aio.Server | None = None
        self._health: Any = None  # grpc_health.v1.health.aio.HealthServicer (untyped)
        self._http: MetricsHttpServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def reload_recovery(self, settings: RecoverySettings) -> None:
        """New ``[recovery]`` settings (SIGHUP): the policy's apply now, the launcher's at the next start.

        A changed launcher setting (LAUNCHER_FIELDS) is logged and the value
        in force kept, so ``self.recovery.settings`` describes the launcher in use.

        Raises:
            ConfigError: a bad option of the chosen launcher (nothing changes then).
        """
        launcher_from(settings, self._send_stop)  # only to check the options: building one does nothing
        current = self.recovery.settings
        changed = [name for name in LAUNCHER_FIELDS if getattr(settings, name) != getattr(current, name)]
        if changed:
            changes = ", ".join(
                f"{name} {getattr(current, name)!r} -> {getattr(settings, name)!r}" for name in changed
            )
            logger.warning(
                "recovery: the launcher is built at start: restart the coordinator to apply %s; "
                "kept those in force, applied the rest",
                changes,
            )
            settings = dataclasses.replace(settings, **{name: getattr(current, name) for name in changed})
        self.recovery.apply_settings(settings)

    def _verified_slurm_jobs(self, job: str) -> set[str]:
        """A job's verified SLURM job ids, for the SLURM launcher (on the event loop, like every launcher call)."""
        record = self.core.jobs.jobs.get(job)
        return record.verified_slurm_job_ids() if record is not None else set()

    async def _send_stop(
        self, node_id: str, stop: agent_pb2.StopWorkersCommand, timeout_s: float
    ) -> agent_pb2.CommandResult:
        """The torchrun launcher's way to a node's agent."""
        command = agent_pb2.Command(
            command_id=f"stop-{uuid.uuid4().hex[:12]}", issued_unix_seconds=time.time(), stop_workers=stop
        )
        return await self.core.send_command(node_id, command, timeout_s)

    async def start(self) -> None:
        """Serve, and join the group when coordinator.etcd is set.

        Raises:
            OSError: an address cannot be bound.
            FailedPreconditionError: another live coordinator holds this shard id.
            EtcdUnavailableError: etcd cannot be reached.
        """
        self._loop = asyncio.get_running_loop()
        if self.settings.etcd:
            shard_id = self.settings.shard_id or socket.gethostname()
            membership = self.membership = Membership(
                Etcd(self.settings.etcd, tls=self._etcd_tls),
                self.settings.etcd_prefix,
                Member(shard_id, ""),
            )
            self.core.fencing_token = lambda: membership.fencing_token
        # gRPC's aio objects bind to the running loop: create them here, not in __init__.
        self._server = grpc.aio.server(
            interceptors=[ErrorMappingInterceptor(gate=self.access.gate)], options=SERVER_OPTIONS
        )
        self._health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        # One setting configures the fleet: in agents mode every stream is asked for digests.
        # Nothing is said in the default mode, where agents send full reports unasked.
        lean = self.settings.hardware_series == "agents"
        report_settings = agent_pb2.ReportSettings(digest=True) if lean else None
        self.group = (
            GroupDuties(self.membership, self.settings.etcd_prefix, self.core, self.watchdog, self.recovery)
            if self.membership is not None
            else None
        )
        self.homing = self.group.homing if self.group is not None else None
        agent_pb2_grpc.add_AgentServiceServicer_to_server(
            AgentServicer(self.core, self.access, report_settings, self.homing), self._server
        )
        calls = CoreCalls(self._loop)
        add_cluster_service(
            self._cluster_servicer(calls, LiveViews(self.core, self.watchdog, self.membership)), self._server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        services = (
            agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name,
            cluster_pb2.DESCRIPTOR.services_by_name["ClusterService"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(services, self._server)
        self.grpc_port = add_grpc_port(
            self._server,
            self.settings.listen,
            self._tls.server_credentials() if self._tls is not None else None,
            "coordinator.listen",
        )
        await self._server.start()
        for service in services[:2]:
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        if self.settings.api_listen:
            # The core's loop keeps the interpreter busy: a thread waiting for it gets it after this
            # interval (5 ms by default), and answering one call takes dozens of such turns.
            sys.setswitchinterval(API_SWITCH_INTERVAL_S)
            recent = RecentViews(
                lambda: take_views(self.core, self.watchdog, group=self.membership),
                calls,
                lambda: self.core.now()[0],
            )
            self._api = ApiThread(
                self.settings.api_listen,
                lambda: self._cluster_servicer(calls, recent),
                [ErrorMappingInterceptor(gate=self.access.gate)],
                self._tls.server_credentials() if self._tls is not None else None,
            )
            self.api_port = await self._api.start()
        if self.settings.metrics_listen:
            self._http = MetricsHttpServer(
                self.settings.metrics_listen,
                self.render_metrics,
                lambda: True,
                key="coordinator.metrics_listen",
                web=load_web_config(self.settings.web_config_file, "coordinator.web_config_file"),
            )
            self._http.start()
            self.metrics_port = self._http.port
        logger.info(
            "coordinator serving gRPC on port %d (ClusterService also on %s), /metrics on %s, state in %s",
            self.grpc_port,
            self.api_port or "(no api_listen)",
            self.metrics_port or "(off)",
            self.settings.state_dir,
        )
        self._tasks = [
            asyncio.create_task(self.core.watch_lag(), name="lag"),
            asyncio.create_task(self.core.watch_liveness(), name="liveness"),
            asyncio.create_task(self.core.tick_acks(), name="acks"),
            asyncio.create_task(self._watch_incidents(), name="detection"),
            asyncio.create_task(self.recovery.run(), name="recovery"),
            asyncio.create_task(self.avoidance.run(), name="avoided interfaces"),
        ]
        if self.settings.history_retention_days > 0:
            retention_s = self.settings.history_retention_days * SECONDS_PER_DAY
            self._tasks.append(
                asyncio.create_task(keep_pruned(self.core.event_log, retention_s), name="retention")
            )
        if self.membership is not None:
            await self._join_group(self.membership)
            self._tasks.append(asyncio.create_task(self.membership.stay(), name="group"))
            if self.group is not None:
                self._tasks.append(asyncio.create_task(self.group.run(), name="group duties"))
        if self.settings.ready_file:
            self._write_ready_file(Path(self.settings.ready_file))

    async def _join_group(self, membership: Membership) -> None:
        host, _, port = self.settings.advertise.rpartition(":")
        host = host or socket.gethostname()
        membership.me = dataclasses.replace(
            membership.me,
            address=f"{host}:{port if port not in ('', '0') else self.grpc_port}",
            api_address=f"{host}:{self.api_port}" if self.api_port else "",
            metrics_address=f"{host}:{self.metrics_port}" if self.metrics_port else "",
        )
        await membership.join()

    def _fenced(self) -> str | None:
        """Why recovery may not act now (Recovery's ``fenced``), or None."""
        return self.membership.fenced() if self.membership is not None else None

    def _cluster_servicer(self, calls: CoreCalls, views: ViewSource) -> ClusterServicer:
        return ClusterServicer(self.core, self.watchdog, self.actions, self.access, calls=calls, views=views)

    async def _watch_incidents(self) -> None:
        """Detection rounds forever (cancel to stop); see Watchdog."""
        try:
            await self.watchdog.run(lambda: self.core.jobs.jobs, self.core.state.nodes)
        finally:
            await self.watchdog.close()

    def render_metrics(self) -> bytes:
        """Called from the HTTP thread: copy state on the loop, render here."""
        assert self._loop is not None  # noqa: S101 - start() ran
        page = asyncio.run_coroutine_threadsafe(self._page(), self._loop).result(RENDER_SNAPSHOT_TIMEOUT_S)
        return render(
            page.nodes,
            page.training,
            page.incidents,
            page.recovery,
            reports_rejected=page.reports_rejected,
            state_db=page.state,
            load=page.load,
            hardware=self.settings.hardware_series == "coordinator",
            nvlink_per_link=self.settings.nvlink_series == "link",
        )

    async def _page(self) -> MetricsPage:
        core = self.core
        return MetricsPage(
            nodes=node_views(core.state),
            training=training_view(core.jobs, core.checkpoints, core.now()[0]),
            incidents=incident_view(self.watchdog, core.jobs.jobs),
            recovery=recovery_view(self.recovery.counts, time.time()),
            reports_rejected=dict(core.reports_rejected_total),
            state=core.event_log.health(),
            load=LoadView(
                lag=core.lag.read(core.now()[0]),
                agent_streams=len(core.sessions),
                agents_waiting=core.streams.waiting(),
                streams_refused={reason.value: n for reason, n in core.streams.refused_total.items()},
                group=(
                    GroupView(self.membership.holds_lease(), len(self.membership.members))
                    if self.membership is not None
                    else None
                ),
            ),
        )

    def _write_ready_file(self, path: Path) -> None:
        ready = {
            "grpc_port": self.grpc_port,
            "api_port": self.api_port,
            "metrics_port": self.metrics_port,
            "pid": os.getpid(),
        }
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(ready))
        tmp.replace(path)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then shut down gracefully.

        Under systemd (Type=notify) it says READY=1 once gRPC and /metrics
        serve, pings the watchdog from this loop, and says STOPPING=1 on the way out.
        """
        try:
            await self.start()
        except ClusterwatchError:  # e.g. it could not join its group: close what started, say why
            await self.stop()
            raise
        watchdog = sd_notify.start_watchdog()
        sd_notify.notify(
            sd_notify.READY,
            sd_notify.status(
                f"serving gRPC on port {self.grpc_port}, /metrics on {self.metrics_port or '(off)'}"
            ),
        )
        try:
            await stop.wait()
            logger.info("coordinator shutting down")
            sd_notify.notify(sd_notify.STOPPING, sd_notify.status("stopping"))
            await self.stop()
        finally:
            await sd_notify.stop_watchdog(watchdog)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._api is not None:
            await self._api.stop()
        if self.membership is not None:
            await self.membership.leave()
            await self.membership.etcd.close()
        if self._server is not None:
            await self._server.stop(SHUTDOWN_GRACE_S)
        if self._http:
            self._http.close()
        self.core.event_log.close()
