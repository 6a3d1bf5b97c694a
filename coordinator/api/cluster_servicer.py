"""ClusterService: snapshots, the Watch stream, events, incidents, thresholds and actions, over Coordinator."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any, cast

import grpc

from clusterwatch import __version__, config
from clusterwatch.coordinator.api import request_checks
from clusterwatch.coordinator.api.access import AccessPolicy
from clusterwatch.coordinator.api.cluster_views import ClusterViews, ViewSource
from clusterwatch.coordinator.api.core_calls import CoreCalls
from clusterwatch.coordinator.api.job_requests import check_begin, check_end
from clusterwatch.coordinator.detection.watchdog import Watchdog
from clusterwatch.coordinator.ingest.core import Coordinator
from clusterwatch.coordinator.model.incidents import IncidentState
from clusterwatch.coordinator.model.state import Event, EventKind
from clusterwatch.coordinator.recovery.actions import Actions
from clusterwatch.coordinator.views.jobs import JobView, job_status, job_view
from clusterwatch.coordinator.views.nodes import NodeView, node_status
from clusterwatch.coordinator.views.topology import cluster_topology
from clusterwatch.errors import ClusterwatchError, InvalidRequestError
from clusterwatch.v1 import cluster_pb2, cluster_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = cluster_pb2.DESCRIPTOR.services_by_name["ClusterService"].full_name
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
    """Reads are open; actions need an admin credential (see coordinator/api/access.py) and are recorded.

    It serves on the core's event loop, or from the API thread's
    (coordinator/api/api_thread.py): ``views`` is where snapshots and live
    incidents come from, and everything else that touches the core's state goes
    through ``calls`` (coordinator/api/core_calls.py), a plain call on the core's loop.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        watchdog: Watchdog,
        actions: Actions,
        access: AccessPolicy | None = None,
        *,
        calls: CoreCalls,
        views: ViewSource,
    ) -> None:
        self._core = coordinator
        self._watchdog = watchdog
        self._actions = actions
        self._access = access or AccessPolicy({}, ())
        self._calls = calls
        self._views = views
        # summary_only -> (the views, the build of their whole snapshot, serialized).
        self._built: dict[bool, tuple[ClusterViews, asyncio.Future[bytes]]] = {}
        # summary_only -> (build began, monotonic; the build) shared by Watch streams.
        self._shared: dict[bool, tuple[float, asyncio.Future[bytes]]] = {}

    async def _authorize(self, context: grpc.aio.ServicerContext[Any, Any], what: str) -> str:
        """The admin principal asking for ``what``, recorded in the event log.

        Raises:
            UnauthenticatedError / PermissionDeniedError: no valid admin credential.
        """
        try:
            who = self._access.require_admin(context, what)
        except ClusterwatchError as exc:
            logger.warning("refused %s from %s: %s", what, context.peer(), exc)
            raise
        event = Event(EventKind.ADMIN_REQUEST, "", time.time(), f"{who}: {what}")
        await self._calls.run(lambda: self._core.record([event]))
        return who

    async def snapshot(
        self, summary_only: bool = False, nodes: Collection[str] = (), jobs: Collection[str] = ()
    ) -> bytes:
        """A ClusterSnapshot, serialized: nodes and jobs (when either is given, exactly those named,
        unknown names left out, and the incidents about them; else everything); jobs are small, so
        summaries keep them whole.

        Built from views (coordinator/api/cluster_views.py). A whole snapshot of the same views
        (recent views are read many times) is built and serialized once: its bytes are shared, each
        answer appending only its own views_age_seconds (protobuf merges concatenated messages).
        """
        views = await self._views.read(nodes, jobs)
        if nodes or jobs:
            body = await self._build(views, summary_only)
        else:
            built = self._built.get(summary_only)
            if built is None or built[0] is not views:
                build = asyncio.ensure_future(self._build(views, summary_only))
                built = self._built[summary_only] = (views, build)
            # Shielded: a caller that goes away does not cancel the build others wait for.
            body = await asyncio.shield(built[1])
        age_s = max(0.0, self._core.now()[0] - views.taken_mono_s)
        age = cluster_pb2.ClusterSnapshot(coordinator=cluster_pb2.CoordinatorHealth(views_age_seconds=age_s))
        return body + age.SerializeToString()

    async def _build(self, views: ClusterViews, summary_only: bool) -> bytes:
        """The snapshot of ``views``, serialized. Thousands of nodes take a second of CPU, and the
        loop that answers other calls must not wait that long: on the core's loop the messages are
        built NODES_PER_SLICE nodes (and one job) at a time, letting the loop run between slices;
        from the API thread, by a worker thread."""
        snapshot = cluster_pb2.ClusterSnapshot(
            timestamp_unix_seconds=views.taken_unix_s,
            coordinator_version=__version__,
            incidents=[i.proto for i in views.incidents],
            coordinator=views.health,
        )
        if not self._calls.on_core():
            return await asyncio.to_thread(_serialized, snapshot, views.nodes, views.jobs, summary_only)
        for start in range(0, len(views.nodes), NODES_PER_SLICE):
            _add_statuses(snapshot, views.nodes[start : start + NODES_PER_SLICE], (), summary_only)
            await asyncio.sleep(0)
        for job in views.jobs:
            _add_statuses(snapshot, (), (job,), summary_only)
            await asyncio.sleep(0)
        return snapshot.SerializeToString()

    async def shared_snapshot(self, summary_only: bool) -> bytes:
        """The whole snapshot, whose build began at most SHARED_SNAPSHOT_MAX_AGE_S ago (for Watch streams):
        the streams that ask while it is being built wait for the same build."""
        now_mono = self._core.now()[0]
        shared = self._shared.get(summary_only)
        if shared is None or now_mono - shared[0] > SHARED_SNAPSHOT_MAX_AGE_S:
            build = asyncio.ensure_future(self.snapshot(summary_only))
            shared = self._shared[summary_only] = (now_mono, build)
        # Shielded: a Watch that ends does not cancel the build the others wait for.
        return await asyncio.shield(shared[1])

    # GetSnapshot and Watch answer serialized snapshots (see add_cluster_service).
    async def GetSnapshot(  # type: ignore[override]  # noqa: N802 - gRPC method name
        self, request: cluster_pb2.GetSnapshotRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        request_checks.check_get_snapshot(request)
        return await self.snapshot(request.summary_only, request.nodes, request.jobs)

    async def Watch(  # type: ignore[override]  # noqa: N802
        self, request: cluster_pb2.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        request_checks.check_watch(request)
        interval_s = max(MIN_WATCH_INTERVAL_S, request.interval_seconds or DEFAULT_WATCH_INTERVAL_S)
        while True:
            yield await self.shared_snapshot(request.summary_only)
            await asyncio.sleep(interval_s)

    async def ListEvents(  # noqa: N802
        self, request: cluster_pb2.ListEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.ListEventsResponse:
        request_checks.check_list_events(request)
        stored = await self._calls.run(
            lambda: self._core.event_log.events(
                after_id=request.after_id, limit=request.limit or DEFAULT_EVENT_LIMIT, node_id=request.node_id
            )
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
            stored = await self._calls.run(lambda: self._core.event_log.incidents(True, request.job, limit))
            return cluster_pb2.ListIncidentsResponse(incidents=[i.to_proto() for i in stored])
        live = await self._views.live_incidents()
        return cluster_pb2.ListIncidentsResponse(
            incidents=[i.proto for i in live if not request.job or i.job == request.job][-limit:]
        )

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
        await self._authorize(
            context, f"incident {request.id} -> {cluster_pb2.IncidentState.Name(request.state).lower()}"
        )
        state = IncidentState.from_proto(request.state)
        return await self._calls.run(lambda: self._watchdog.move(request.id, state).to_proto())

    async def GetDetectionSettings(  # noqa: N802
        self, request: cluster_pb2.GetDetectionSettingsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.DetectionSettings:
        return cluster_pb2.DetectionSettings(
            values=await self._calls.run(lambda: config.as_strings(self._watchdog.settings))
        )

    async def UpdateDetectionSettings(  # noqa: N802
        self, request: cluster_pb2.UpdateDetectionSettingsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.DetectionSettings:
        request_checks.check_update_detection_settings(request)
        changes = dict(request.values)
        await self._authorize(
            context, "detection settings " + ", ".join(f"{k}={v}" for k, v in sorted(changes.items()))
        )
        settings = await self._calls.run(lambda: self._watchdog.update_settings(changes))
        return cluster_pb2.DetectionSettings(values=config.as_strings(settings))

    async def ListActions(  # noqa: N802
        self, request: cluster_pb2.ListActionsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.ListActionsResponse:
        request_checks.check_list_actions(request)
        actions = await self._calls.run(
            lambda: self._core.event_log.actions(
                request.job, request.incident_id, request.limit or DEFAULT_EVENT_LIMIT
            )
        )
        return cluster_pb2.ListActionsResponse(actions=actions)

    async def RequestAction(  # noqa: N802
        self, request: cluster_pb2.ActionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.ActionResponse:
        request_checks.check_action(request)
        who = await self._authorize(context, f"{request.action or 'action'} of job {request.job!r}")
        time_remaining = context.time_remaining()
        return await self._calls.run_async(
            lambda: self._actions.request(request, time_remaining, requested_by=who)
        )

    async def BeginJob(  # noqa: N802
        self, request: cluster_pb2.BeginJobRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.JobStatus:
        check_begin(request)
        await self._authorize(context, f"begin job {request.job!r}")
        return job_status(await self._calls.run(lambda: self._begin_job(request)))

    def _begin_job(self, request: cluster_pb2.BeginJobRequest) -> JobView:
        core = self._core
        core.begin_job(request.job, request.labels, request.nodes)
        view = job_view(
            core.jobs, core.checkpoints, request.job, core.now()[0], self._watchdog.detection.slowdown_ratios
        )
        assert view is not None  # noqa: S101 - registered just now, in this call on the core's loop
        return view

    async def EndJob(  # noqa: N802
        self, request: cluster_pb2.EndJobRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cluster_pb2.EndJobResponse:
        check_end(request)
        await self._authorize(context, f"end job {request.job!r}")
        ended = await self._calls.run(lambda: self._core.end_job(request.job, request.reason))
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
        return await self._calls.run(
            lambda: cluster_topology(self._core.state, self._core.jobs, request.node, request.job)
        )


def add_cluster_service(servicer: ClusterServicer, server: grpc.aio.Server) -> None:
    """Serve ``servicer`` on ``server``, GetSnapshot and Watch sending the bytes it serialized.

    The generated registration serializes every answer: a whole snapshot is megabytes, asked for
    by every `top` every second, and serializing the same one again per caller would cost the
    coordinator more than building it once.
    """
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    class Registration:  # takes the generated handlers instead of a server
        def add_generic_rpc_handlers(self, generic: object) -> None:
            pass

        def add_registered_method_handlers(self, service: str, method_handlers: dict[str, Any]) -> None:
            handlers.update(method_handlers)

    cluster_pb2_grpc.add_ClusterServiceServicer_to_server(servicer, cast(grpc.aio.Server, Registration()))
    for method in ("GetSnapshot", "Watch"):
        handlers[method] = handlers[method]._replace(response_serializer=_as_bytes)  # type: ignore[attr-defined]
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)  # type: ignore[attr-defined]  # as generated


def _as_bytes(answer: bytes) -> bytes:
    return answer


def _serialized(
    snapshot: cluster_pb2.ClusterSnapshot,
    nodes: Sequence[NodeView],
    jobs: Sequence[JobView],
    summary_only: bool,
) -> bytes:
    _add_statuses(snapshot, nodes, jobs, summary_only)
    return snapshot.SerializeToString()


def _add_statuses(
    snapshot: cluster_pb2.ClusterSnapshot,
    nodes: Sequence[NodeView],
    jobs: Sequence[JobView],
    summary_only: bool,
) -> None:
    snapshot.nodes.extend(node_status(v, summary_only) for v in nodes)
    snapshot.jobs.extend(job_status(j) for j in jobs)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
