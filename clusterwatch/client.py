"""A small synchronous client of the ClusterService, for the CLI."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType

import grpc

from clusterwatch.config import ClientSettings
from clusterwatch.errors import ConfigError, UnreachableError
from clusterwatch.runtime.grpc_options import CHANNEL_OPTIONS
from clusterwatch.runtime.reach import tls_paths, why_unreachable
from clusterwatch.runtime.tls import credentials
from clusterwatch.v1 import cluster_pb2, cluster_pb2_grpc
from clusterwatch.wire.recovery_names import RESTORE_INTERFACES, restart_action


class ClusterClient:
    """Talks to a coordinator's ClusterService.

    Args:
        address: HOST:PORT of the coordinator.
        timeout_s: deadline of each call.
        credentials: mutual TLS (None: plaintext).
        token: admin token sent with actions (checkpoint, restart, incident,
            settings and job changes); reading needs none.
    """

    def __init__(
        self,
        address: str,
        timeout_s: float = 5.0,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        token: str = "",
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.channel = (
            grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
            if credentials is None
            else grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
        )
        self._stub = cluster_pb2_grpc.ClusterServiceStub(self.channel)
        self._admin: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()

    @classmethod
    def from_settings(cls, settings: ClientSettings) -> ClusterClient:
        """A client as ``[client]`` says: address, timeout, TLS or plaintext, admin token.

        Raises:
            ConfigError: naming the key of an unusable TLS or token setting.
        """
        return client_factory(settings)()

    def snapshot(
        self, summary_only: bool = False, nodes: Sequence[str] = (), jobs: Sequence[str] = ()
    ) -> cluster_pb2.ClusterSnapshot:
        """The cluster now; with ``nodes`` or ``jobs``, exactly those (and the incidents about them)."""
        request = cluster_pb2.GetSnapshotRequest(summary_only=summary_only, nodes=nodes, jobs=jobs)
        return self._stub.GetSnapshot(request, timeout=self.timeout_s, wait_for_ready=True)

    def watch(self, interval_s: float = 0.0) -> Iterator[cluster_pb2.ClusterSnapshot]:
        """Snapshots as the coordinator sends them: one now, then one every ``interval_s``
        (0: the coordinator's default of 1 s), until :meth:`close` or the stream breaks.

        The stream has no deadline: it lasts as long as the caller reads. It does not
        wait for an unreachable coordinator: that fails at once with UNAVAILABLE.

        Raises:
            grpc.RpcError: the stream ended (UNAVAILABLE when the coordinator went away,
                CANCELLED after :meth:`close`).
        """
        request = cluster_pb2.WatchRequest(interval_seconds=interval_s)
        yield from self._stub.Watch(request)

    def events(self, after_id: int = 0, limit: int = 0, node_id: str = "") -> list[cluster_pb2.Event]:
        request = cluster_pb2.ListEventsRequest(after_id=after_id, limit=limit, node_id=node_id)
        response = self._stub.ListEvents(request, timeout=self.timeout_s, wait_for_ready=True)
        return list(response.events)

    def request_checkpoint(
        self, job: str, step: int | None = None, idempotency_key: str = ""
    ) -> cluster_pb2.ActionResponse:
        """Ask every rank of ``job`` to checkpoint at the end of ``step``.

        Args:
            job: the job's name.
            step: the step to save at; None lets the coordinator pick one a
                little ahead of the furthest rank.
            idempotency_key: makes retries safe: the same key gets the same
                action and step.

        Returns:
            The action id, the step every rank was asked to save at, and which
            nodes relayed the request. Completion shows later as the job's
            ``latest_complete_checkpoint_step``.

        Raises:
            grpc.RpcError: NOT_FOUND (unknown job), INVALID_ARGUMENT (bad
                step), FAILED_PRECONDITION (no running rank reachable).
        """
        request = cluster_pb2.ActionRequest(job=job, action="checkpoint", idempotency_key=idempotency_key)
        if step is not None:
            request.step = step
        return self._stub.RequestAction(
            request, timeout=self.timeout_s, wait_for_ready=True, metadata=self._admin
        )

    def restart(self, job: str, exclude_nodes: list[str] | None = None) -> cluster_pb2.ActionResponse:
        """Restart ``job`` (its workers are stopped; the launcher restarts them from the newest
        complete checkpoint), optionally for good without ``exclude_nodes``.

        Raises:
            grpc.RpcError: NOT_FOUND (unknown job), INVALID_ARGUMENT, UNIMPLEMENTED (no launcher).
        """
        action = restart_action(exclude_nodes)
        request = cluster_pb2.ActionRequest(job=job, action=action, exclude_nodes=exclude_nodes or [])
        return self._stub.RequestAction(
            request, timeout=self.timeout_s, wait_for_ready=True, metadata=self._admin
        )

    def restore_interfaces(self, job: str) -> cluster_pb2.ActionResponse:
        """Let ``job``'s workers use the interfaces avoid_interface kept them off again (from their next start).

        Raises:
            grpc.RpcError: NOT_FOUND (no node keeps the job off an interface), INVALID_ARGUMENT.
        """
        request = cluster_pb2.ActionRequest(job=job, action=RESTORE_INTERFACES)
        return self._stub.RequestAction(
            request, timeout=self.timeout_s, wait_for_ready=True, metadata=self._admin
        )

    def begin_job(
        self, job: str, labels: dict[str, str] | None = None, nodes: list[str] | None = None
    ) -> cluster_pb2.JobStatus:
        """Register ``job`` before its ranks report (idempotent; labels and nodes add up).

        Raises:
            grpc.RpcError: INVALID_ARGUMENT naming the bad field.
        """
        request = cluster_pb2.BeginJobRequest(job=job, labels=labels or {}, nodes=nodes or [])
        return self._stub.BeginJob(request, timeout=self.timeout_s, wait_for_ready=True, metadata=self._admin)

    def end_job(self, job: str, reason: str = "") -> cluster_pb2.EndJobResponse:
        """Tell the coordinator ``job`` ended on purpose: its incidents resolve, its ranks' exits
        are not failures, its series go (idempotent).

        Raises:
            grpc.RpcError: INVALID_ARGUMENT naming the bad field.
        """
        request = cluster_pb2.EndJobRequest(job=job, reason=reason)
        return self._stub.EndJob(request, timeout=self.timeout_s, wait_for_ready=True, metadata=self._admin)

    def actions(self, job: str = "", incident_id: str = "", limit: int = 0) -> list[cluster_pb2.ActionRecord]:
        """Recovery decisions and operator requests, with their outcomes, oldest first."""
        request = cluster_pb2.ListActionsRequest(job=job, incident_id=incident_id, limit=limit)
        return list(self._stub.ListActions(request, timeout=self.timeout_s, wait_for_ready=True).actions)

    def incidents(
        self, include_resolved: bool = False, job: str = "", limit: int = 0
    ) -> list[cluster_pb2.Incident]:
        """Live incidents (and resolved ones with ``include_resolved``), oldest first."""
        request = cluster_pb2.ListIncidentsRequest(include_resolved=include_resolved, job=job, limit=limit)
        response = self._stub.ListIncidents(request, timeout=self.timeout_s, wait_for_ready=True)
        return list(response.incidents)

    def update_incident(
        self, incident_id: str, state: cluster_pb2.IncidentState.ValueType
    ) -> cluster_pb2.Incident:
        """Acknowledge or resolve an incident.

        Raises:
            grpc.RpcError: NOT_FOUND (no live incident with that id),
                FAILED_PRECONDITION (the state machine forbids the move).
        """
        request = cluster_pb2.UpdateIncidentRequest(id=incident_id, state=state)
        return self._stub.UpdateIncident(
            request, timeout=self.timeout_s, wait_for_ready=True, metadata=self._admin
        )

    def detection_settings(self, changes: dict[str, str] | None = None) -> dict[str, str]:
        """The detection thresholds in force, after applying ``changes`` (by setting name) if given.

        Raises:
            grpc.RpcError: INVALID_ARGUMENT naming the bad key (nothing changed).
        """
        if changes:
            request = cluster_pb2.UpdateDetectionSettingsRequest(values=changes)
            response = self._stub.UpdateDetectionSettings(
                request, timeout=self.timeout_s, wait_for_ready=True, metadata=self._admin
            )
        else:
            response = self._stub.GetDetectionSettings(
                cluster_pb2.GetDetectionSettingsRequest(), timeout=self.timeout_s, wait_for_ready=True
            )
        return dict(response.values)

    def topology(self, node: str = "", job: str = "") -> cluster_pb2.ClusterTopology:
        """How the nodes are wired, where each rank runs on that wiring, and the findings about it.

        Args:
            node: only this node (its topology, the ranks on it); empty: every node.
            job: only this job's placements and findings; empty: every job.

        Raises:
            grpc.RpcError: NOT_FOUND (unknown node), UNIMPLEMENTED (a coordinator
                older than GetTopology).
        """
        request = cluster_pb2.GetTopologyRequest(node=node, job=job)
        return self._stub.GetTopology(request, timeout=self.timeout_s, wait_for_ready=True)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def read_token(path: str, key: str = "client.token_file") -> str:
    """The admin token in ``path``: its first word, after the last ``:`` (so the
    coordinator's ``NAME:TOKEN`` file works too); empty path: no token.

    Raises:
        ConfigError: naming ``key`` when the file cannot be read or holds no token.
    """
    if not path:
        return ""
    try:
        lines = Path(path).read_text().split()
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}") from None
    if not lines:
        raise ConfigError(key, f"{path} holds no token")
    return lines[0].rpartition(":")[2]


def client_factory(settings: ClientSettings) -> Callable[..., ClusterClient]:
    """Makes clients as ``[client]`` says, of its coordinator or of the ``address`` given (another of
    its group); files are read once, here.

    Raises:
        ConfigError: naming the key of an unusable TLS or token setting.
    """
    tls = credentials(settings, "client")
    channel_credentials = tls.channel_credentials() if tls else None
    token = read_token(settings.token_file)

    def make(address: str = settings.coordinator) -> ClusterClient:
        return ClusterClient(address, settings.timeout_s, credentials=channel_credentials, token=token)

    return make


def connect(
    settings: ClientSettings, make: Callable[..., ClusterClient] | None = None, within_s: float = 1.0
) -> ClusterClient:
    """A client of ``settings.coordinator`` whose channel is ready, or, when it is not ready within
    ``within_s``, the reason in one line. A server that answers gRPC but slowly is waited for as
    every call waits (``timeout_s``). ``make``: the command's client_factory(settings), if it has
    one already (its files are read once).

    Raises:
        ConfigError: naming the key of an unusable TLS or token setting.
        UnreachableError: refused, not resolved, TLS refused or missing, not a gRPC port.
    """
    client = (make or client_factory(settings))()
    try:
        grpc.channel_ready_future(client.channel).result(timeout=within_s)
    except grpc.FutureTimeoutError:
        reason = why_unreachable(settings.coordinator, tls_paths(settings), timeout_s=within_s)
        if reason is not None:
            client.close()
            raise UnreachableError(reason) from None
    return client
