"""Maps clusterwatch exceptions to gRPC status codes (clusterwatch/wire/grpc_status.py's table), for every RPC.

It also runs the access gate (coordinator/api/access.py) before every RPC, inside
the same mapping, so a refused peer gets PERMISSION_DENIED with the reason.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from clusterwatch.errors import ClusterwatchError, InvalidRequestError
from clusterwatch.wire.grpc_status import status_for, trailing_metadata

logger = logging.getLogger(__name__)

# Runs before every RPC with the method's full name and the call's context; raises to refuse it.
Gate = Callable[[str, Any], None]


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Turns a ClusterwatchError raised by a servicer (or by ``gate``) into the matching status.

    Args:
        gate: called before each RPC's handler; what it raises refuses the call.
    """

    def __init__(self, gate: Gate | None = None) -> None:
        self._gate = gate

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        for kind, factory in _FACTORIES.items():
            behavior = getattr(handler, kind)
            if behavior is not None:
                decode = handler.request_deserializer
                if kind.startswith("stream_"):  # the servicer's reads decode: make a failure ours
                    return factory(  # type: ignore[no-any-return]
                        _wrap(behavior, method, self._gate),
                        request_deserializer=_decoding(decode),
                        response_serializer=handler.response_serializer,
                    )
                return factory(  # type: ignore[no-any-return]  # decoded in _wrap, where it can fail
                    _wrap(behavior, method, self._gate, decode),
                    request_deserializer=None,
                    response_serializer=handler.response_serializer,
                )
        return handler


_FACTORIES: dict[str, Callable[..., Any]] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: ClusterwatchError, method: str) -> None:
    code = status_for(exc)
    trailing = trailing_metadata(exc)
    if trailing:  # many a second when the coordinator is at capacity or agents move: not logged each
        logger.debug("%s -> %s: %s", method, code.name, exc)
        context.set_trailing_metadata(trailing)
    else:
        logger.info("%s -> %s: %s", method, code.name, exc)
    await context.abort(code, str(exc))


def _decoding(decode: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``decode`` raising InvalidRequestError instead of protobuf's DecodeError (status UNKNOWN)."""
    if decode is None:
        return None

    def checked(raw: bytes) -> Any:
        try:
            return decode(raw)
        except DecodeError as exc:
            raise InvalidRequestError(f"not a valid protobuf message ({exc})") from None

    return checked


def _wrap(
    behavior: Callable[..., Any],
    method: str,
    gate: Gate | None,
    decode: Callable[[bytes], Any] | None = None,
) -> Callable[..., Any]:
    """``behavior`` after ``gate``, with ClusterwatchError mapped to a status; with ``decode``, the
    request arrives as bytes."""
    checked = _decoding(decode)
    if inspect.isasyncgenfunction(behavior):

        async def stream_wrapper(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            try:
                if gate is not None:
                    gate(method, context)
                if checked is not None:
                    request = checked(request)
                async for item in behavior(request, context):
                    yield item
            except ClusterwatchError as exc:
                await _abort(context, exc, method)

        return stream_wrapper

    async def wrapper(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            if gate is not None:
                gate(method, context)
            if checked is not None:
                request = checked(request)
            return await behavior(request, context)
        except ClusterwatchError as exc:
            await _abort(context, exc, method)

    return wrapper
