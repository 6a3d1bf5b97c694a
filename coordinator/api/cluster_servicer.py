"""ClusterService: snapshots, the Watch stream, events, incidents, thresholds and actions, over Coordinator."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Collection
from typing import Any

import grpc

from clusterwatch import __version__, config
from clusterwatch.coordinator.api import request_checks
from clusterwatch.coordinator.api.access import AccessPolicy
from clusterwatch.coordinator.api.job_requests import check_begin, check_end
from clusterwatch.coordinator.detection.watchdog import Watchdog
from clusterwatch.coordinator.ingest.core import Coordinator
from clusterwatch.coordinator.model.incidents import IncidentState
from clusterwatch.coordinator.model.state import Event, EventKind
from clusterwatch.coordinator.recovery.actions import Actions
from clusterwatch.coordinator.views.jobs import job_status, job_view, training_view
from clusterwatch.coordinator.views.nodes import node_status, node_views
from clusterwatch.coordinator.views.topology import cluster_topology
from clusterwatch.errors import ClusterwatchError, InvalidRequestError
from clusterwatch.v1 import cluster_pb2, cluster_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_WATCH_INTERVAL_S = 1.0
MIN_WATCH_INTERVAL_S = 0.1
# Watch streams share a snapshot built at most this long ago (half the default interval): with
# many `top`s open, one is built per interval instead of one per client.
SHARED_SNAPSHOT_MAX_AGE_S = 0.5
# Node statuses built between two turns of the event loop (ClusterServicer.snapshot).
NODES_PER_SLICE = 100
DEFAULT_EVENT_LIMIT = 1000
_SETTABLE_STATES = (
    cluster_pb2.IncidentState.INCIDENT_STATE_ACKNOWLEDGED,
    cluster_pb2.IncidentState.INCIDENT_STATE_RESOLVED,
)


class ClusterServicer(cluster_pb2_grpc.ClusterServiceServicer):
    """Reads are open; actions need an admin credential (see coordinator/api/access.py) and are recorded."""

    def __init__(
        self,
        coordinator: Coordinator,
        watchdog: Watchdog,
        actions: Actions,
        access: AccessPolicy | None = None,
    ) -> None:
        self._core = coordinator
        self._watchdog = watchdog
        self._actions = actions
        self._access = access or AccessPolicy({}, ())
        # summary_only -> (build began, monotonic; the build) shared by Watch streams.
        self._shared: dict[bool, tuple[float, asyncio.Future[cluster_pb2.ClusterSnapshot]]] = {}

    def _authorize(self, context: grpc.aio.ServicerContext[Any, Any], what: str) -> str:
        """The admin principal asking for ``what``, recorded in the event log.

        Raises:
            UnauthenticatedError / PermissionDeniedError: no valid admin credential.
        """
        try:
            who = self._access.require_admin(context, what)
        except ClusterwatchError as exc:
            logger.warning("refused %s from %s: %s", what, context.peer(), exc)
            raise
        self._core.record([Event(EventKind.ADMIN_REQUEST, "", time.time(), f"{who}: {what}")])
        return who

    async def snapshot(
        self, summary_only: bool = False, nodes: Collection[str] = (), jobs: Collection[str] = ()
    ) -> cluster_pb2.ClusterSnapshot:
        """Nodes and jobs now; jobs are small, so summaries keep them whole.

        Built NODES_PER_SLICE nodes (and one job) at a time, letting the event loop run between
        slices: a snapshot of thousands of nodes takes a second of CPU, and the loop reading reports
        and answering other calls must not wait that long. The views are taken at once; each node's
        status is consistent in itself, and the reports it reads are never changed once stored.

        Args:
            nodes / jobs: when either is given, exactly the nodes and jobs named (unknown names are
                left out) and the incidents about them; else everything.
        """
        core = self._core
        now_mono = core.now()[0]
        filtered = bool(nodes or jobs)
        wanted_nodes, wanted_jobs = frozenset(nodes), frozenset(jobs)
        training = training_view(
            core.jobs,
            core.checkpoints,
            now_mono,
            self._watchdog.detection.slowdown_ratios,
            only=wanted_jobs if filtered else None,
        )
        incidents = self._watchdog.book.live()
        if filtered:
            incidents = [i for i in incidents if i.job in wanted_jobs or not wanted_nodes.isdisjoint(i.nodes)]
        views = node_views(core.state, only=wanted_nodes if filtered else None)
        snapshot = cluster_pb2.ClusterSnapshot(
            timestamp_unix_seconds=time.time(),
            coordinator_version=__version__,
            incidents=[i.to_proto() for i in incidents],
            coordinator=self._health(now_mono),
        )
        for start in range(0, len(views), NODES_PER_SLICE):
            snapshot.nodes.extend(
                node_status(v, summary_only) for v in views[start : start + NODES_PER_SLICE]
            )
            await asyncio.sleep(0)
        for job in training.jobs:
            snapshot.jobs.append(job_status(job))
            await asyncio.sleep(0)
        return snapshot

    def _health(self, now_mono: float) -> cluster_pb2.CoordinatorHealth:
        core = self._core
        lag = core.lag.read(now_mono)
        return cluster_pb2.CoordinatorHealth(
            lag_seconds=lag.lag_s,
            loop_delay_seconds=lag.loop_delay_s,
            report_age_seconds=lag.report_age_s,
            behind=lag.behind,
            verdicts_held=lag.held,
            agent_streams=len(core.sessions),
            streams_refused_last_minute=core.streams.refused_recently(now_mono),
        )

    async def shared_snapshot(self, summary_only: bool) -> cluster_pb2.ClusterSnapshot:
        """The whole snapshot, whose build began at most SHARED_SNAPSHOT_MAX_AGE_S ago (for Watch streams):
        the streams that ask while it is being built wait for the same build."""
        now_mono = self._core.now()[0]
        shared = self._shared.get(summary_only)
        if shared is None or now_mono - shared[0] > SHARED_SNAPSHOT_MAX_AGE_S:
            build = asyncio.ensure_future(self.snapshot(summary_only))
            shared = self._shared[summary_only] = (now_mono, build)
        # Shielded: a Watch that ends does not cancel the build the others wait for.
        return await asyncio.shield(shared[1])

    async def GetSnapshot(  # noqa: N802 - gRPC method name
        self, request: cluster_pb2.GetSnapshotRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.ClusterSnapshot:
        request_checks.check_get_snapshot(request)
        return await self.snapshot(request.summary_only, request.nodes, request.jobs)

    async def Watch(  # noqa: N802
        self, request: cluster_pb2.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[cluster_pb2.ClusterSnapshot]:
        request_checks.check_watch(request)
        interval_s = max(MIN_WATCH_INTERVAL_S, request.interval_seconds or DEFAULT_WATCH_INTERVAL_S)
        while True:
            yield await self.shared_snapshot(request.summary_only)
            await asyncio.sleep(interval_s)

    async def ListEvents(  # noqa: N802
        self, request: cluster_pb2.ListEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.ListEventsResponse:
        request_checks.check_list_events(request)
        stored = self._core.event_log.events(
            after_id=request.after_id, limit=request.limit or DEFAULT_EVENT_LIMIT, node_id=request.node_id
        )
        return cluster_pb2.ListEventsResponse(
            events=[
                cluster_pb2.Event(
                    id=e.id,
                    timestamp_unix_seconds=e.timestamp_unix_s,
                    kind=e.kind,
                    node_id=e.node_id,
                    detail=e.detail,
                )
                for e in stored
            ]
        )

    async def ListIncidents(  # noqa: N802
        self, request: cluster_pb2.ListIncidentsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.ListIncidentsResponse:
        request_checks.check_list_incidents(request)
        limit = request.limit or DEFAULT_EVENT_LIMIT
        if request.include_resolved:  # history lives in the database
            incidents = self._core.event_log.incidents(True, request.job, limit)
        else:
            live = self._watchdog.book.live()
            incidents = [i for i in live if not request.job or i.job == request.job][-limit:]
        return cluster_pb2.ListIncidentsResponse(incidents=[i.to_proto() for i in incidents])

    async def UpdateIncident(  # noqa: N802
        self, request: cluster_pb2.UpdateIncidentRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.Incident:
        request_checks.check_update_incident(request)
        if not request.id:
            raise InvalidRequestError("id is empty")
        if request.state not in _SETTABLE_STATES:
            raise InvalidRequestError(
                f"state must be INCIDENT_STATE_ACKNOWLEDGED or INCIDENT_STATE_RESOLVED, got {request.state}"
            )
        self._authorize(
            context, f"incident {request.id} -> {cluster_pb2.IncidentState.Name(request.state).lower()}"
        )
        return self._watchdog.move(request.id, IncidentState.from_proto(request.state)).to_proto()

    async def GetDetectionSettings(  # noqa: N802
        self, request: cluster_pb2.GetDetectionSettingsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.DetectionSettings:
        return cluster_pb2.DetectionSettings(values=config.as_strings(self._watchdog.settings))

    async def UpdateDetectionSettings(  # noqa: N802
        self, request: cluster_pb2.UpdateDetectionSettingsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.DetectionSettings:
        request_checks.check_update_detection_settings(request)
        changes = dict(request.values)
        self._authorize(
            context, "detection settings " + ", ".join(f"{k}={v}" for k, v in sorted(changes.items()))
        )
        settings = self._watchdog.update_settings(changes)
        return cluster_pb2.DetectionSettings(values=config.as_strings(settings))

    async def ListActions(  # noqa: N802
        self, request: cluster_pb2.ListActionsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.ListActionsResponse:
        request_checks.check_list_actions(request)
        actions = self._core.event_log.actions(
            request.job, request.incident_id, request.limit or DEFAULT_EVENT_LIMIT
        )
        return cluster_pb2.ListActionsResponse(actions=actions)

    async def RequestAction(  # noqa: N802
        self, request: cluster_pb2.ActionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.ActionResponse:
        request_checks.check_action(request)
        who = self._authorize(context, f"{request.action or 'action'} of job {request.job!r}")
        return await self._actions.request(request, context.time_remaining(), requested_by=who)

    async def BeginJob(  # noqa: N802
        self, request: cluster_pb2.BeginJobRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.JobStatus:
        check_begin(request)
        self._authorize(context, f"begin job {request.job!r}")
        core = self._core
        core.begin_job(request.job, request.labels, request.nodes)
        view = job_view(
            core.jobs, core.checkpoints, request.job, core.now()[0], self._watchdog.detection.slowdown_ratios
        )
        assert view is not None  # noqa: S101 - registered just now, on this thread
        return job_status(view)

    async def EndJob(  # noqa: N802
        self, request: cluster_pb2.EndJobRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.EndJobResponse:
        check_end(request)
        self._authorize(context, f"end job {request.job!r}")
        ended = self._core.end_job(request.job, request.reason)
        if ended.known:
            message = (
                f"job {request.job} ended: {_count(ended.ranks, 'rank')} dropped, "
                f"{_count(ended.incidents_resolved, 'incident')} resolved"
            )
        else:
            message = (
                f"job {request.job} was not known (already ended, or no rank reported and not registered)"
            )
        return cluster_pb2.EndJobResponse(
            known=ended.known, ranks=ended.ranks, incidents_resolved=ended.incidents_resolved, message=message
        )

    async def GetTopology(  # noqa: N802
        self, request: cluster_pb2.GetTopologyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.ClusterTopology:
        request_checks.check_get_topology(request)
        return cluster_topology(self._core.state, self._core.jobs, request.node, request.job)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
