"""Checks on what training hooks send, so bad data is refused by field name before it is stored."""

from __future__ import annotations

import math

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from clusterwatch.errors import ClusterwatchError
from clusterwatch.job_labels import labels_problem
from clusterwatch.v1 import training_pb2


class InvalidHookMessageError(ClusterwatchError):
    """A hook message breaks the protocol or carries impossible values (INVALID_ARGUMENT).

    Attributes:
        field: where the problem is, e.g. ``steps[2].compute_seconds`` or ``hello.world_size``.
    """

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        super().__init__(f"{field}: {problem}")


class RankGoneError(ClusterwatchError):
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


# Every double in training.proto is a duration, a timestamp, a count or a
# rate: none may be negative, NaN or infinite. Per message type, which fields
# to check and which sub-messages to descend into, worked out once.
_Plan = tuple[tuple[str, ...], tuple[tuple[str, bool], ...]]
_PLANS: dict[str, _Plan] = {}
_FLOATING = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)


def _plan(descriptor: Descriptor) -> _Plan:
    plan = _PLANS.get(descriptor.full_name)
    if plan is None:
        numbers = tuple(f.name for f in descriptor.fields if f.type in _FLOATING and not f.is_repeated)
        children = tuple(
            (f.name, f.is_repeated)
            for f in descriptor.fields
            if f.type == FieldDescriptor.TYPE_MESSAGE and _ours(f.message_type)
        )
        plan = _PLANS[descriptor.full_name] = (numbers, children)
    return plan


def _ours(descriptor: Descriptor | None) -> bool:
    """A clusterwatch message (descend into it), not a well-known type."""
    return descriptor is not None and descriptor.full_name.startswith("clusterwatch.")


def check_values(message: Message, field: str) -> None:
    """Refuse a negative, NaN or infinite number anywhere in ``message``.

    Raises:
        InvalidHookMessageError: naming the first bad field, e.g. ``steps[2].compute_seconds``.
    """
    numbers, children = _plan(message.DESCRIPTOR)  # type: ignore[arg-type]  # upb's Descriptor is the same API
    for name in numbers:
        value = getattr(message, name)
        if not 0.0 <= value < math.inf:  # False for NaN too
            raise InvalidHookMessageError(f"{field}.{name}", f"must be a finite number >= 0, got {value!r}")
    for name, repeated in children:
        if repeated:
            for index, child in enumerate(getattr(message, name)):
                check_values(child, f"{field}.{name}[{index}]")
        elif message.HasField(name):
            check_values(getattr(message, name), f"{field}.{name}")
