"""An asyncio client for the part of etcd's v3 API clusterwatch uses: keys, leases, transactions, watches.

etcd's own gRPC API, generated from its protos (proto/clusterwatch/etcd/, committed like ours) and
called with grpc.aio: no third-party etcd client. The maintained Python clients either pin old
protobuf or gRPC releases that conflict with ours, or wrap a compiled client; the API we need is
small and its protos are etcd's stable v3 contract.

Keys and values are str and bytes; every call has a deadline. A failure to reach etcd raises
EtcdUnavailableError naming the endpoint and what failed (refused, not found, TLS, deadline).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import grpc

from clusterwatch.errors import ClusterwatchError, ConfigError
from clusterwatch.etcd import kv_pb2, rpc_pb2, rpc_pb2_grpc
from clusterwatch.runtime.grpc_options import CHANNEL_OPTIONS
from clusterwatch.runtime.tls import TlsFiles

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0


class EtcdUnavailableError(ClusterwatchError):
    """etcd could not be reached or did not answer in time."""


class LeaseLostError(ClusterwatchError):
    """A lease expired or was revoked: whatever was held under it is gone."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One key, with the revisions that order its writes."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclasses.dataclass(frozen=True)
class Change:
    """One watched write: ``value`` is None for a deletion (or a lease's expiry)."""

    key: str
    value: bytes | None
    revision: int
    # The revision at which the key was created (0 for a deletion).
    create_revision: int = 0


def parse_endpoints(endpoints: str, key: str = "etcd") -> tuple[list[str], bool]:
    """``http://host:port,https://host:port`` (or bare host:port) -> (["host:port", ...], uses TLS).

    Raises:
        ConfigError: empty, or a mix of http and https (naming the setting ``key``).
    """
    hosts: list[str] = []
    schemes: set[str] = set()
    for item in (part.strip() for part in endpoints.split(",")):
        if not item:
            continue
        parsed = urlsplit(item if "://" in item else f"http://{item}")
        if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.port is None:
            raise ConfigError(key, f"{item!r} is not http(s)://HOST:PORT")
        schemes.add(parsed.scheme)
        hosts.append(parsed.netloc)
    if not hosts:
        raise ConfigError(key, "no endpoint given")
    if len(schemes) > 1:
        raise ConfigError(key, "the endpoints mix http and https")
    return hosts, schemes == {"https"}


class Etcd:
    """One channel to an etcd cluster.

    Args:
        endpoints: ``http(s)://host:port`` separated by commas; calls go to the first that answers
            (gRPC's pick_first over the list).
        tls: client certificate, key and CA for https endpoints (None: the system's roots, no
            client certificate).
        timeout_s: deadline of each unary call.
    """

    def __init__(
        self, endpoints: str, *, tls: TlsFiles | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        hosts, secure = parse_endpoints(endpoints)
        self.endpoints = ",".join(hosts)
        target = hosts[0] if len(hosts) == 1 else f"ipv4:{','.join(hosts)}"
        if secure:
            credentials = tls.channel_credentials() if tls is not None else grpc.ssl_channel_credentials()
            self._channel = grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._kv = rpc_pb2_grpc.KVStub(self._channel)
        self._lease = rpc_pb2_grpc.LeaseStub(self._channel)
        self._watch = rpc_pb2_grpc.WatchStub(self._channel)
        self._timeout_s = timeout_s

    async def close(self) -> None:
        await self._channel.close(None)

    async def __aenter__(self) -> Etcd:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._unavailable(exc) from exc

    def _unavailable(self, exc: grpc.aio.AioRpcError) -> EtcdUnavailableError:
        return EtcdUnavailableError(f"etcd at {self.endpoints}: {exc.code().name}: {exc.details()}")

    async def get(self, key: str) -> Entry | None:
        response = await self._call(self._kv.Range, rpc_pb2.RangeRequest(key=key.encode()))
        return _entry(response.kvs[0]) if response.kvs else None

    async def get_prefix(self, prefix: str) -> tuple[list[Entry], int]:
        """Every key under ``prefix``, sorted, and the store's revision they were read at."""
        start = prefix.encode()
        response = await self._call(
            self._kv.Range, rpc_pb2.RangeRequest(key=start, range_end=_prefix_end(start))
        )
        return [_entry(kv) for kv in response.kvs], response.header.revision

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """The revision of the write."""
        response = await self._call(
            self._kv.Put, rpc_pb2.PutRequest(key=key.encode(), value=value, lease=lease)
        )
        return int(response.header.revision)

    async def delete(self, key: str) -> int:
        """How many keys were deleted (0 or 1)."""
        response = await self._call(self._kv.DeleteRange, rpc_pb2.DeleteRangeRequest(key=key.encode()))
        return int(response.deleted)

    async def put_if(self, key: str, value: bytes, mod_revision: int, lease: int = 0) -> int | None:
        """Write ``key`` only if its last write was at ``mod_revision`` (0: only if it does not exist).

        Returns:
            The revision of the write, or None when the key had moved on (nothing written).
        """
        compare = rpc_pb2.Compare(
            key=key.encode(),
            result=rpc_pb2.Compare.CompareResult.EQUAL,
            target=rpc_pb2.Compare.CompareTarget.MOD,
            mod_revision=mod_revision,
        )
        put = rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key.encode(), value=value, lease=lease))
        response = await self._call(self._kv.Txn, rpc_pb2.TxnRequest(compare=[compare], success=[put]))
        return int(response.header.revision) if response.succeeded else None

    async def write_while(
        self, key: str, value: bytes | None, guard_key: str, guard_create_revision: int
    ) -> bool:
        """Write ``key`` (delete it for None) only while ``guard_key`` is the one created at
        ``guard_create_revision``: a coordinator's own membership key, so that one that has left its
        group (its lease ran out) writes nothing. Whether it was written.
        """
        compare = rpc_pb2.Compare(
            key=guard_key.encode(),
            result=rpc_pb2.Compare.CompareResult.EQUAL,
            target=rpc_pb2.Compare.CompareTarget.CREATE,
            create_revision=guard_create_revision,
        )
        write = (
            rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=key.encode()))
            if value is None
            else rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key.encode(), value=value))
        )
        response = await self._call(self._kv.Txn, rpc_pb2.TxnRequest(compare=[compare], success=[write]))
        return bool(response.succeeded)

    async def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""
        response = await self._call(self._lease.LeaseGrant, rpc_pb2.LeaseGrantRequest(TTL=ttl_s))
        if response.error:
            raise EtcdUnavailableError(f"etcd at {self.endpoints}: lease not granted: {response.error}")
        return int(response.ID)

    async def revoke(self, lease: int) -> None:
        await self._call(self._lease.LeaseRevoke, rpc_pb2.LeaseRevokeRequest(ID=lease))

    async def renew(self, lease: int) -> int:
        """Renew ``lease`` once; the seconds it has left.

        Raises:
            LeaseLostError: etcd says the lease no longer exists (it expired or was revoked).
            EtcdUnavailableError: etcd could not be reached; the lease runs out at its TTL.
        """
        # A grpc.aio stream call (the generated stubs are typed for the blocking API).
        call: Any = self._lease.LeaseKeepAlive(timeout=self._timeout_s)  # type: ignore[call-arg]
        try:
            await call.write(rpc_pb2.LeaseKeepAliveRequest(ID=lease))
            await call.done_writing()
            response: rpc_pb2.LeaseKeepAliveResponse | None = await anext(aiter(call), None)
        except grpc.aio.AioRpcError as exc:
            raise self._unavailable(exc) from exc
        finally:
            call.cancel()
        if response is None:
            raise EtcdUnavailableError(f"etcd at {self.endpoints}: the keep-alive stream ended unanswered")
        if response.TTL <= 0:
            raise LeaseLostError(f"lease {lease:x} expired or was revoked")
        return int(response.TTL)

    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[list[Change]]:
        """The writes under ``prefix`` from ``start_revision`` on, a batch per etcd response, until
        cancelled.

        Raises:
            EtcdUnavailableError: the watch stream failed (the caller reads again and resumes).
        """
        start = prefix.encode()
        create = rpc_pb2.WatchCreateRequest(
            key=start, range_end=_prefix_end(start), start_revision=start_revision
        )
        call: Any = self._watch.Watch()  # type: ignore[call-arg]  # a grpc.aio stream call
        try:
            await call.write(rpc_pb2.WatchRequest(create_request=create))
            response: rpc_pb2.WatchResponse
            async for response in call:
                if response.canceled:
                    reason = response.cancel_reason or f"compacted at {response.compact_revision}"
                    raise EtcdUnavailableError(f"etcd at {self.endpoints}: watch cancelled: {reason}")
                if response.events:
                    yield [_change(event) for event in response.events]
            raise EtcdUnavailableError(f"etcd at {self.endpoints}: the watch stream ended")
        except grpc.aio.AioRpcError as exc:
            raise self._unavailable(exc) from exc
        finally:
            call.cancel()


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key starting with ``prefix`` (etcd's range_end for a prefix)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


def _entry(kv: kv_pb2.KeyValue) -> Entry:
    return Entry(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision, kv.lease)


def _change(event: kv_pb2.Event) -> Change:
    deleted = event.type == kv_pb2.Event.EventType.DELETE
    return Change(
        event.kv.key.decode(),
        None if deleted else event.kv.value,
        event.kv.mod_revision,
        0 if deleted else event.kv.create_revision,
    )
