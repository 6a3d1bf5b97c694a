"""Checks on what training hooks send, so bad data is refused by field name before it is stored.

What the agent forwards must pass the coordinator's checks too
(coordinator/ingest/report_checks.py and rank_reports.py), or the coordinator
refuses a whole rank's report; so both read one table
(clusterwatch/wire/limits.py): ids at most MAX_ID_CHARS characters, free text
MAX_TEXT_CHARS, counted repeated fields,
every number finite and >= 0, and collective histograms of the shape in
clusterwatch/wire/collective_stats.py. The hook and the agent share the host's
clock, so a ``*_unix_seconds`` more than MAX_CLOCK_SKEW_S in the future is
refused too (earlier ones are left alone: they only order a rank's own events).
A heartbeat's process groups (clusterwatch/hook/process_groups.py) are named,
each once, and have at least two members, given either as a progression
(``stride`` > 0, no ``ranks``) or listed (``stride`` 0, ``ranks`` the
``size`` members in increasing order); ``check_process_groups`` also holds
the members below the rank's world size, for callers that have its identity.
No hook message carries an enum.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from clusterwatch.errors import FailedPreconditionError, InvalidReportError
from clusterwatch.v1 import training_pb2
from clusterwatch.wire.job_labels import labels_problem
from clusterwatch.wire.limits import (
    DEFAULT_MAX_ENTRIES,
    DURATION_BUCKETS,
    MAX_CLOCK_SKEW_S,
    MAX_ENTRIES,
    MAX_ID_CHARS,
    MAX_TEXT_CHARS,
    REPEATED_STRING_CHARS,
    TEXT_FIELDS,
    V1,
)


class InvalidHookMessageError(InvalidReportError):
    """A hook message breaks the protocol or carries impossible values (INVALID_ARGUMENT).

    Attributes:
        field: where the problem is, e.g. ``steps[2].compute_seconds`` or ``hello.world_size``.
    """

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        super().__init__(f"{field}: {problem}")


class RankGoneError(FailedPreconditionError):
    """A message for a training process the agent already reported as exited (FAILED_PRECONDITION)."""


def check_identity(identity: training_pb2.RankIdentity, field: str) -> None:
    """Refuse an identity no real training process can have.

    Raises:
        InvalidHookMessageError: naming ``field.<member>``.
    """
    if not identity.instance_id:
        raise InvalidHookMessageError(f"{field}.instance_id", "must not be empty")
    if not identity.job:
        raise InvalidHookMessageError(f"{field}.job", "must not be empty")
    if identity.pid == 0:
        raise InvalidHookMessageError(f"{field}.pid", "must be the process id, got 0")
    if identity.world_size == 0:
        raise InvalidHookMessageError(f"{field}.world_size", "must be at least 1, got 0")
    if identity.rank >= identity.world_size:
        raise InvalidHookMessageError(
            f"{field}.rank", f"must be below world_size {identity.world_size}, got {identity.rank}"
        )
    if identity.local_rank >= identity.world_size:
        raise InvalidHookMessageError(
            f"{field}.local_rank",
            f"must be below world_size {identity.world_size}, got {identity.local_rank}",
        )
    if identity.labels and (problem := labels_problem(identity.labels)):
        raise InvalidHookMessageError(f"{field}.labels", problem)
    for name in _IDENTITY_STRINGS:
        _check_length(getattr(identity, name), MAX_ID_CHARS, f"{field}.{name}")


_IDENTITY_STRINGS = tuple(
    f.name for f in training_pb2.RankIdentity.DESCRIPTOR.fields if f.type == FieldDescriptor.TYPE_STRING
)


def _check_length(value: str, limit: int, field: str) -> None:
    if len(value) > limit:
        raise InvalidHookMessageError(
            field, f"at most {limit} characters, got {len(value)} ({value[:32]!r}...)"
        )


def check_process_groups(
    heartbeat: training_pb2.Heartbeat, identity: training_pb2.RankIdentity, field: str = "heartbeat"
) -> None:
    """Refuse a process group with a member at or above the rank's world size.

    The rest of each group's shape is checked by ``check_values``; this needs
    the identity the heartbeat's stream announced (the hook holds its groups
    back until the agent has been told its current identity).

    Raises:
        InvalidHookMessageError: naming ``field.process_groups[i]``.
    """
    world_size = identity.world_size
    for index, group in enumerate(heartbeat.process_groups):
        if group.stride:
            last = group.first_rank + group.stride * (group.size - 1)
        else:
            last = max(group.ranks, default=group.first_rank)
        if last >= world_size:
            raise InvalidHookMessageError(
                f"{field}.process_groups[{index}]",
                f"member {last} of group {group.group_name!r} is not below world_size {world_size}",
            )


def _check_membership(group: training_pb2.ProcessGroupMembership, field: str) -> None:
    """A group of at least two members, either a progression or a strictly increasing list."""
    if not group.group_name:
        raise InvalidHookMessageError(f"{field}.group_name", "must not be empty")
    if group.size < 2:
        raise InvalidHookMessageError(
            f"{field}.size", f"must be at least 2 (groups of one are not sent), got {group.size}"
        )
    if group.stride:
        if group.ranks:
            raise InvalidHookMessageError(f"{field}.ranks", "must be empty when stride gives the members")
        if group.first_rank + group.stride * (group.size - 1) > _MAX_RANK:
            raise InvalidHookMessageError(
                f"{field}.stride",
                f"first_rank {group.first_rank} + stride {group.stride} x (size {group.size} - 1) "
                "is past the largest rank",
            )
        return
    if len(group.ranks) != group.size:
        raise InvalidHookMessageError(
            f"{field}.ranks",
            f"must list size ({group.size}) members when stride is 0, got {len(group.ranks)}",
        )
    ranks = group.ranks
    if any(ranks[i] >= ranks[i + 1] for i in range(len(ranks) - 1)):
        raise InvalidHookMessageError(f"{field}.ranks", "must be strictly increasing")


def _check_heartbeat(heartbeat: training_pb2.Heartbeat, field: str) -> None:
    names = [group.group_name for group in heartbeat.process_groups]
    if len(set(names)) != len(names):
        duplicate = next(name for name in names if names.count(name) > 1)
        raise InvalidHookMessageError(f"{field}.process_groups", f"group {duplicate!r} is listed twice")


_MAX_RANK = (1 << 32) - 1
# Checks of one message type's fields together, run after its own fields' checks.
_RULES: dict[str, Callable[[Any, str], None]] = {
    f"{V1}ProcessGroupMembership": _check_membership,
    f"{V1}Heartbeat": _check_heartbeat,
}

# Every double in training.proto is a duration, a timestamp, a count or a
# rate: none may be negative, NaN or infinite. Per message type, which fields
# to check (and how), which sub-messages to descend into and which rule
# checks the fields together, worked out once.
_Plan = tuple[
    tuple[str, ...],
    tuple[tuple[str, int], ...],
    tuple[tuple[str, str, int, int | None], ...],  # (name, full name, entries, characters per string)
    tuple[tuple[str, bool], ...],
    Callable[[Any, str], None] | None,
]
_PLANS: dict[str, _Plan] = {}
_FLOATING = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)


def _plan(descriptor: Descriptor) -> _Plan:
    """(numbers, (string, limit), (repeated, full name, limit), (child, repeated), rule) of one message type."""
    plan = _PLANS.get(descriptor.full_name)
    if plan is None:
        fields = descriptor.fields
        numbers = tuple(f.name for f in fields if f.type in _FLOATING and not f.is_repeated)
        strings = tuple(
            (f.name, MAX_TEXT_CHARS if f.name in TEXT_FIELDS else MAX_ID_CHARS)
            for f in fields
            if f.type == FieldDescriptor.TYPE_STRING and not f.is_repeated
        )
        repeated = tuple(
            (
                f.name,
                f.full_name,
                MAX_ENTRIES.get(f.full_name, DEFAULT_MAX_ENTRIES),
                REPEATED_STRING_CHARS.get(f.full_name),
            )
            for f in fields
            if f.is_repeated
        )
        children = tuple(
            (f.name, f.is_repeated)
            for f in fields
            if f.type == FieldDescriptor.TYPE_MESSAGE and _ours(f.message_type)
        )
        rule = _RULES.get(descriptor.full_name)
        plan = _PLANS[descriptor.full_name] = (numbers, strings, repeated, children, rule)
    return plan


def _ours(descriptor: Descriptor | None) -> bool:
    """A clusterwatch message (descend into it), not a map entry or a well-known type."""
    return (
        descriptor is not None
        and descriptor.full_name.startswith("clusterwatch.")
        and not descriptor.GetOptions().map_entry
    )


def check_values(message: Message, field: str, now_unix_s: float | None = None) -> None:
    """Refuse a bad number, an oversized string or list, or a malformed histogram anywhere in ``message``.

    Args:
        message: a step summary, heartbeat or checkpoint result.
        field: its name in the errors (``steps[2]``).
        now_unix_s: the agent's wall clock (default: now).

    Raises:
        InvalidHookMessageError: naming the first bad field, e.g. ``steps[2].compute_seconds``.
    """
    _check(message, field, time.time() if now_unix_s is None else now_unix_s)


def _check(message: Message, field: str, now_unix_s: float) -> None:
    numbers, strings, repeated, children, rule = _plan(message.DESCRIPTOR)  # type: ignore[arg-type]  # upb's Descriptor is the same API
    for name in numbers:
        value = getattr(message, name)
        if not 0.0 <= value < math.inf:  # False for NaN too
            raise InvalidHookMessageError(f"{field}.{name}", f"must be a finite number >= 0, got {value!r}")
        if name.endswith("_unix_seconds") and value > now_unix_s + MAX_CLOCK_SKEW_S:
            raise InvalidHookMessageError(
                f"{field}.{name}",
                f"more than {MAX_CLOCK_SKEW_S:g} s after this host's clock ({now_unix_s:.0f}), got {value!r}",
            )
    for name, limit in strings:
        _check_length(getattr(message, name), limit, f"{field}.{name}")
    for name, full_name, limit, chars in repeated:
        _check_repeated(getattr(message, name), full_name, limit, chars, f"{field}.{name}")
    if rule is not None:
        rule(message, field)
    for name, is_repeated in children:
        if is_repeated:
            for index, child in enumerate(getattr(message, name)):
                _check(child, f"{field}.{name}[{index}]", now_unix_s)
        elif message.HasField(name):
            _check(getattr(message, name), f"{field}.{name}", now_unix_s)


def _check_repeated(values: Any, full_name: str, limit: int, chars: int | None, field: str) -> None:
    count = len(values)
    if count > limit:
        raise InvalidHookMessageError(field, f"at most {limit} entries, got {count}")
    if chars is not None:
        for index, value in enumerate(values):
            _check_length(value, chars, f"{field}[{index}]")
    if full_name == f"{V1}CollectiveSummary.duration_bucket_counts" and count != DURATION_BUCKETS:
        raise InvalidHookMessageError(
            field,
            f"must have {DURATION_BUCKETS} entries (see clusterwatch/wire/collective_stats.py), got {count}",
        )


def check_batch(steps: list[training_pb2.StepSummary]) -> None:
    """Refuse a StepBatch with more steps than a hook sends at once.

    Raises:
        InvalidHookMessageError: naming ``steps``.
    """
    limit = MAX_ENTRIES[f"{V1}StepBatch.steps"]
    if len(steps) > limit:
        raise InvalidHookMessageError("steps", f"at most {limit} entries, got {len(steps)}")


class RefuseUndecodable(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Ends a stream whose message is not valid protobuf with INVALID_ARGUMENT (for HookServer).

    gRPC decodes a streamed message when the servicer reads it, so protobuf's
    DecodeError would leave the servicer as an unhandled exception: status
    UNKNOWN and a traceback in the log. Decoded here, it is an
    InvalidHookMessageError like any other bad message, which the servicer
    counts and answers. (Every hook method streams its requests.)
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if handler is None or handler.stream_stream is None or handler.request_deserializer is None:
            return handler
        decode = handler.request_deserializer

        def refusing(raw: bytes) -> Any:
            try:
                return decode(raw)
            except DecodeError as exc:
                raise InvalidHookMessageError("message", f"not a valid protobuf message ({exc})") from None

        return grpc.stream_stream_rpc_method_handler(
            handler.stream_stream,
            request_deserializer=refusing,
            response_serializer=handler.response_serializer,
        )
