"""Maps clusterwatch exceptions to gRPC status codes, for every RPC, in one place."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from clusterwatch.errors import (
    ClusterwatchError,
    ConfigError,
    FailedPreconditionError,
    InvalidReportError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnimplementedError,
)

logger = logging.getLogger(__name__)

STATUS_BY_ERROR: tuple[tuple[type[ClusterwatchError], grpc.StatusCode], ...] = (
    (InvalidReportError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (UnimplementedError, grpc.StatusCode.UNIMPLEMENTED),
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
)


def status_for(exc: ClusterwatchError) -> grpc.StatusCode:
    for error_type, code in STATUS_BY_ERROR:
        if isinstance(exc, error_type):
            return code
    return grpc.StatusCode.INTERNAL


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Turns a ClusterwatchError raised by a servicer into the matching status."""

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
                return factory(  # type: ignore[no-any-return]
                    _wrap(behavior, method),
                    request_deserializer=handler.request_deserializer,
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
    logger.info("%s -> %s: %s", method, code.name, exc)
    await context.abort(code, str(exc))


def _wrap(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def stream_wrapper(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            try:
                async for item in behavior(request, context):
                    yield item
            except ClusterwatchError as exc:
                await _abort(context, exc, method)

        return stream_wrapper

    async def wrapper(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            return await behavior(request, context)
        except ClusterwatchError as exc:
            await _abort(context, exc, method)

    return wrapper
