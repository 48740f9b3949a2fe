"""Server interceptors every specd server installs (no torch: the orchestrator uses them too).

- `BearerToken`: with auth on, a call without `authorization: Bearer <token>` (or with another
  token) ends UNAUTHENTICATED before it reaches a servicer. grpc.health.v1 stays open, so load
  balancers, `specd up` and the orchestrator's readiness wait can probe without a token.
- `MalformedRequests`: bytes that do not parse as the method's request message (a string that
  is not UTF-8, a truncated field) end INVALID_ARGUMENT with the parser's reason; without it
  gRPC answers INTERNAL, which docs/architecture.md §5 keeps for real bugs.
"""

import hmac
from collections.abc import Callable

import grpc

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


class BearerToken(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self.expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self.expected):
            return handler
        reason = "no `authorization: Bearer <token>` metadata" if not given else "the bearer token is wrong"
        return _refusing(
            handler,
            grpc.StatusCode.UNAUTHENTICATED,
            f"{reason}: this server requires a token (pass --token or set SPECD_TOKEN)",
        )


class MalformedRequests(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        method = details.method

        def tolerant_parse(data: bytes):
            try:
                return parse(data)
            except Exception as error:  # the parser's reason travels to the client
                return _Unparsable(f"the request is not a valid message for {method}: {error}")

        return _rewrap(handler, tolerant_parse, _refuse_unparsable)


class _Unparsable:
    def __init__(self, message: str):
        self.message = message


def _refuse_unparsable(behavior: Callable, streaming: bool) -> Callable:
    if streaming:

        async def stream(request, context):
            if isinstance(request, _Unparsable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for reply in behavior(request, context):
                yield reply

        return stream

    async def unary(request, context):
        if isinstance(request, _Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)

    return unary


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends every call with (code, message)."""

    def refuse(behavior: Callable, streaming: bool) -> Callable:
        if streaming:

            async def stream(request, context):
                await context.abort(code, message)
                yield  # never reached: makes this an async generator, as the shape needs

            return stream

        async def unary(request, context):
            await context.abort(code, message)

        return unary

    return _rewrap(handler, handler.request_deserializer, refuse)


_FACTORIES = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def _rewrap(handler: grpc.RpcMethodHandler, deserializer, wrap: Callable[[Callable, bool], Callable]):
    """The same method handler with its deserializer replaced and its behaviour wrapped."""
    field, factory = _FACTORIES[(handler.request_streaming, handler.response_streaming)]
    behavior = wrap(getattr(handler, field), handler.response_streaming)
    return factory(behavior, request_deserializer=deserializer, response_serializer=handler.response_serializer)
