"""ClusterService: snapshots, the Watch stream, events, incidents, thresholds and actions, over Coordinator."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
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

    def snapshot(self, summary_only: bool = False) -> cluster_pb2.ClusterSnapshot:
        """Nodes and jobs now; jobs are small, so summaries keep them whole."""
        core = self._core
        training = training_view(
            core.jobs, core.checkpoints, core.now()[0], self._watchdog.detection.slowdown_ratios
        )
        return cluster_pb2.ClusterSnapshot(
            timestamp_unix_seconds=time.time(),
            coordinator_version=__version__,
            nodes=[node_status(v, summary_only) for v in node_views(core.state)],
            jobs=[job_status(job) for job in training.jobs],
            incidents=[i.to_proto() for i in self._watchdog.book.live()],
        )

    async def GetSnapshot(  # noqa: N802 - gRPC method name
        self, request: cluster_pb2.GetSnapshotRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.ClusterSnapshot:
        return self.snapshot(request.summary_only)

    async def Watch(  # noqa: N802
        self, request: cluster_pb2.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[cluster_pb2.ClusterSnapshot]:
        request_checks.check_watch(request)
        interval_s = max(MIN_WATCH_INTERVAL_S, request.interval_seconds or DEFAULT_WATCH_INTERVAL_S)
        while True:
            yield self.snapshot(request.summary_only)
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
