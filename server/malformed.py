"""Requests whose bytes do not parse as the method's message are the caller's
mistake: INVALID_ARGUMENT naming the method (SPEC section 5), not grpc's
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


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Wrap every handler so an undecodable request aborts with INVALID_ARGUMENT."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        message = f"request is not a valid message for {method}"
        kw = {
            "request_deserializer": _lenient(handler.request_deserializer),
            "response_serializer": handler.response_serializer,
        }

        def check(request):
            if isinstance(request, _Undecodable):
                raise MalformedMessage(f"{message}: {request.why}")
            return request

        async def checked(requests):
            async for request in requests:
                yield check(request)

        async def refuse(context, e: MalformedMessage):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

        if handler.unary_unary:
            behavior = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    return await behavior(check(request), context)
                except MalformedMessage as e:
                    await refuse(context, e)

            return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)
        if handler.unary_stream:
            behavior = handler.unary_stream

            async def unary_stream(request, context):
                try:
                    async for reply in behavior(check(request), context):
                        yield reply
                except MalformedMessage as e:
                    await refuse(context, e)

            return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
        if handler.stream_unary:
            behavior = handler.stream_unary

            async def stream_unary(requests, context):
                try:
                    return await behavior(checked(requests), context)
                except MalformedMessage as e:
                    await refuse(context, e)

            return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)
        behavior = handler.stream_stream

        async def stream_stream(requests, context):
            try:
                async for reply in behavior(checked(requests), context):
                    yield reply
            except MalformedMessage as e:
                await refuse(context, e)

        return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)
