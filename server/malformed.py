"""Requests whose bytes do not parse as the method's message are the caller's
mistake: INVALID_ARGUMENT naming the method (docs/protocol.md), not grpc's
UNKNOWN "Unexpected DecodeError"."""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError


class _Undecodable:
    """What the lenient deserializer returns instead of raising."""

    def __init__(self, why: str) -> None:
        self.why = why


class MalformedMessage(Exception):
    pass


def _lenient(deserializer):
    def parse(data: bytes):
        try:
            return deserializer(data)
        except DecodeError as e:
            return _Undecodable(str(e) or "cannot parse")

    return parse


HANDLER_MAKERS = {  # (request streams, response streams) -> grpc's handler constructor
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Wrap every handler so an undecodable request aborts with INVALID_ARGUMENT."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        message = f"request is not a valid message for {handler_call_details.method}"
        kind = (handler.request_streaming, handler.response_streaming)
        behavior = (
            handler.stream_stream
            or handler.stream_unary
            or handler.unary_stream
            or handler.unary_unary
        )

        def check(request):
            if isinstance(request, _Undecodable):
                raise MalformedMessage(f"{message}: {request.why}")
            return request

        async def checked(requests):
            async for request in requests:
                yield check(request)

        prepare = checked if handler.request_streaming else check

        async def refuse(context, e: MalformedMessage) -> None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

        if handler.response_streaming:

            async def wrapped(request, context):
                try:
                    async for reply in behavior(prepare(request), context):
                        yield reply
                except MalformedMessage as e:
                    await refuse(context, e)

        else:

            async def wrapped(request, context):
                try:
                    return await behavior(prepare(request), context)
                except MalformedMessage as e:
                    await refuse(context, e)

        return HANDLER_MAKERS[kind](
            wrapped,
            request_deserializer=_lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
