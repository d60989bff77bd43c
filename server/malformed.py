"""Every call's request messages, received and parsed under limits before a method
sees them.

The handlers grpc gets from `RequestGuard` read their request messages themselves:
- the first message must arrive within the receive timeout, else the call ends with
  DEADLINE_EXCEEDED (a client that starts a message and stalls holds its partial
  message in server memory until then); on a stream, each later message within the
  stream idle timeout, else the stream's requests end as if the client had closed it;
- the bytes are parsed with bounded work (expertd/codec.py's limits, checked before
  protobuf's parse for the messages protobuf reads): bytes that are no message of the
  method's type, or a message breaking a limit, are the caller's mistake,
  INVALID_ARGUMENT naming the method and the problem (docs/protocol.md);
- an exception escaping a method is logged and answered INTERNAL, with no Python
  names in the status.
Methods that take one request are served as request-streaming ones, so grpc never
reads a message on its own: a call refused before its handler runs (auth) is
answered without its body being received or parsed.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from expertd.codec import MessageLimitError, check_limits, parse_forward_request

log = logging.getLogger("expertd.server")

# Parsers that bound their own work (expertd/codec.py): used as they are.
BOUNDED = frozenset({parse_forward_request})
# Messages whose repeated number fields are a tensor's values (the Open Inference
# Protocol's typed contents): bounded by codec.MAX_TENSOR_VALUES, not MAX_REPEATED.
TENSOR_VALUES = frozenset({"inference.InferTensorContents"})


@dataclass(frozen=True, slots=True)
class ReceiveLimits:
    receive_timeout_s: float | None = 30.0  # a call's first request message
    stream_idle_s: float | None = 300.0  # a stream's next request message


class Refusal(Exception):
    """A call refused with `code` and `message` (the caller's mistake)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def bounded_parser(deserializer):
    """The method's deserializer -> a parse of bounded work. Generated message
    classes' FromString are checked against the codec's limits first (protobuf's
    parse is C, but not free: a message of millions of tiny fields costs it up to a
    second); a deserializer that is neither is used as it is."""
    if deserializer is None or deserializer in BOUNDED:
        return deserializer
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    if descriptor is None:
        return deserializer

    def parse(data: bytes):
        check_limits(data, descriptor, TENSOR_VALUES)
        return deserializer(data)

    return parse


def _parse(parse, data: bytes, method: str):
    if parse is None:
        return data
    try:
        return parse(data)
    except MessageLimitError as e:
        raise Refusal(
            grpc.StatusCode.INVALID_ARGUMENT, f"request to {method} refused: {e}"
        ) from None
    except DecodeError as e:
        why = str(e) or "cannot parse"
        raise Refusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request is not a valid message for {method}: {why}",
        ) from None


async def _read(context, timeout: float | None):
    """The next request message's bytes; grpc.aio.EOF at the end; None on timeout."""
    try:
        async with asyncio.timeout(timeout):
            return await context.read()
    except TimeoutError:
        return None


class RequestGuard(grpc.aio.ServerInterceptor):
    """Wrap every handler as described in this module's docstring."""

    def __init__(self, limits: ReceiveLimits | None = None) -> None:
        self.limits = limits or ReceiveLimits()
        self._guarded: dict[tuple[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        key = (handler_call_details.method or "", handler)
        guarded = self._guarded.get(key)
        if guarded is None:  # once per method: the wrapping is the same for every call
            if len(self._guarded) >= 1024:
                self._guarded.clear()
            guarded = self._guarded[key] = guard(handler, key[0], self.limits)
        return guarded


def guard(handler: grpc.RpcMethodHandler, method: str, limits: ReceiveLimits):
    """`handler` as a request-streaming handler that receives and parses its own
    requests (see the module docstring)."""
    behavior = (
        handler.stream_stream or handler.stream_unary or handler.unary_stream or handler.unary_unary
    )
    parse = bounded_parser(handler.request_deserializer)
    first_s, idle_s = limits.receive_timeout_s, limits.stream_idle_s

    def missing(data) -> Refusal:
        if data is None:
            return Refusal(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"request message not received within {first_s:g} s",
            )
        return Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"no request message for {method}")

    async def requests(context):
        """A stream's requests, parsed; ends when the client closes its side or
        sends nothing for `idle_s` (after the first message, due within `first_s`)."""
        data = await _read(context, first_s)
        if data is None or data is grpc.aio.EOF:
            raise missing(data)
        while True:
            yield _parse(parse, data, method)
            data = await _read(context, idle_s)
            if data is None or data is grpc.aio.EOF:
                return

    async def request_of(context):
        if handler.request_streaming:
            return requests(context)
        try:
            async with asyncio.timeout(first_s):
                data = await context.read()
        except TimeoutError:
            data = None
        if data is None or data is grpc.aio.EOF:
            raise missing(data)
        return _parse(parse, data, method)

    async def refuse(context, code: grpc.StatusCode, message: str) -> None:
        if not context.done():
            await context.abort(code, message)

    if handler.response_streaming:
        writes_itself = not inspect.isasyncgenfunction(behavior)  # reader-writer API

        async def wrapped(_requests, context) -> None:
            try:
                request = await request_of(context)
                if writes_itself:
                    await behavior(request, context)
                else:
                    async for reply in behavior(request, context):
                        await context.write(reply)
            except Refusal as e:
                await refuse(context, e.code, e.message)
            except grpc.aio.BaseError:  # grpc's own (an abort, a finished call): as it is
                raise
            except Exception:
                log.exception("%s failed", method)
                await refuse(context, grpc.StatusCode.INTERNAL, f"internal error in {method}")

        maker = grpc.stream_stream_rpc_method_handler
    else:

        async def wrapped(_requests, context):
            try:
                return await behavior(await request_of(context), context)
            except Refusal as e:
                await refuse(context, e.code, e.message)
            except grpc.aio.BaseError:
                raise
            except Exception:
                log.exception("%s failed", method)
                await refuse(context, grpc.StatusCode.INTERNAL, f"internal error in {method}")

        maker = grpc.stream_unary_rpc_method_handler

    return maker(
        wrapped, request_deserializer=None, response_serializer=handler.response_serializer
    )
