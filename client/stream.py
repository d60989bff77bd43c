"""ForwardStream as the transport: one long-lived bidirectional stream per
replica, every call of the client multiplexed over it by request id.

Measured on the H200 machine and on CPU (benchmarks/service.py): a stream round
trip costs 0.3-1.5 ms less than a unary call for small requests and the same
for large ones, so it is the default; `transport="unary"` switches it off.

Failures look like the unary call's: a per-request error answer raises
StreamCallError with its status; a broken or closed stream fails every call in
flight on it with UNAVAILABLE (so the client retries them on another replica)
and is reopened by the next call.
"""

from __future__ import annotations

import asyncio
import itertools

import grpc

from expertd.v1 import expertd_pb2 as pb


class StreamCallError(grpc.RpcError):
    """A call on the stream failed: the same code()/details() as a unary RpcError."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class ForwardStream:
    """The multiplexed stream to one replica (used from the client's event loop only)."""

    def __init__(self, stub, metadata: tuple[tuple[str, str], ...]) -> None:
        self._stub = stub
        self._metadata = metadata  # fixed for the stream's life: client metadata + token
        self._call = None
        self._reader: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._write = asyncio.Lock()  # one write at a time on a call

    async def forward(self, request: pb.ForwardRequest, timeout: float) -> pb.ForwardResponse:
        """Send `request` (its request_id is overwritten) and wait for its answer."""
        request.request_id = rid = next(self._ids)
        request.timeout_us = max(int(timeout * 1e6), 1)  # the server drops it once passed
        answer = asyncio.get_running_loop().create_future()
        self._pending[rid] = answer
        try:
            async with self._write:
                if self._call is None:
                    self._open()
                await asyncio.wait_for(self._call.write(request), timeout)
            reply = await asyncio.wait_for(asyncio.shield(answer), timeout)
        except TimeoutError:
            raise StreamCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed") from None
        except StreamCallError:  # the stream broke while this call was in flight
            raise
        except (grpc.RpcError, asyncio.InvalidStateError) as e:  # the write failed: stream gone
            self._pending.pop(rid, None)
            why = e.details() if isinstance(e, grpc.RpcError) else "stream already ended"
            self._broken(grpc.StatusCode.UNAVAILABLE, why)
            raise StreamCallError(grpc.StatusCode.UNAVAILABLE, f"stream broke: {why}") from None
        finally:
            self._pending.pop(rid, None)
        if reply.HasField("error"):
            code = _CODES.get(reply.error.code, grpc.StatusCode.UNKNOWN)
            raise StreamCallError(code, reply.error.message)
        return reply

    def _open(self) -> None:
        self._call = self._stub.ForwardStream(metadata=self._metadata)
        self._reader = asyncio.ensure_future(self._read(self._call))

    async def _read(self, call) -> None:
        code, why = grpc.StatusCode.UNAVAILABLE, "stream ended by the server"
        try:
            async for reply in call:
                answer = self._pending.get(reply.request_id)
                if answer is not None and not answer.done():
                    answer.set_result(reply)
        except grpc.RpcError as e:
            code, why = e.code(), e.details()
        except asyncio.CancelledError:
            why = "stream closed by the client"
        if self._call is call:
            self._broken(code, why)

    def _broken(self, code: grpc.StatusCode, why: str) -> None:
        """Fail everything in flight with a retryable status; the next call reopens."""
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        # Retryable on another replica, except a refusal of our credentials.
        auth = code == grpc.StatusCode.UNAUTHENTICATED
        status = code if auth else grpc.StatusCode.UNAVAILABLE
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(StreamCallError(status, f"stream: {code.name}: {why}"))
                answer.exception()  # its waiter may have timed out: no "never retrieved" log

    def close(self) -> None:
        if self._call is not None:
            self._broken(grpc.StatusCode.CANCELLED, "client closed")
        if self._reader is not None:
            self._reader.cancel()
