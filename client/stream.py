"""ForwardStream as the transport: one long-lived bidirectional stream per
replica, every call of the client multiplexed over it by request id.

Measured on the H200 machine and on CPU (benchmarks/service.py): a stream round
trip costs 0.3-1.5 ms less than a unary call for small requests and the same
for large ones, so it is the default; `transport="unary"` switches it off.

Failures look like the unary call's: a per-request error answer raises
StreamCallError with its status; a broken or closed stream fails every call in
flight on it with UNAVAILABLE (so the client retries them on another replica)
and is reopened by the next call; an answer that cannot be decoded fails them
with INTERNAL (a server that does not speak the protocol: not retried).

One writer task per stream sends the requests in order; a call never writes
itself, so a call that times out never cancels a write half-way (grpc.aio
cancels the whole stream then). A request whose call has already given up is
not sent, and each request's timeout is what is left of its call's when it is
written, so the server never computes answers nobody waits for. A stream that
gives no answer at all for a whole call's timeout while calls wait on it is
retired: new calls go to a fresh stream, the old one ends once its calls have.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque

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


class _Expired(Exception):
    """A call's answer did not come within its timeout."""


def _expire(answer: asyncio.Future) -> None:
    if not answer.done():
        answer.set_exception(_Expired())
        answer.exception()  # its waiter may be gone (cancelled): no "never retrieved" log


class _Conn:
    """One open ForwardStream call: its writer and reader tasks, the requests
    waiting to be written, and the calls waiting for an answer."""

    __slots__ = ("call", "ended", "last_answer", "outbox", "pending", "reader", "wake", "writer")

    def __init__(self, call) -> None:
        self.call = call
        self.outbox: deque[tuple[pb.ForwardRequest, asyncio.Future, float]] = deque()
        self.wake = asyncio.Event()
        self.pending: dict[int, asyncio.Future] = {}
        self.last_answer = time.monotonic()  # of the last answer read (or the opening)
        self.ended = False
        self.reader: asyncio.Task | None = None
        self.writer: asyncio.Task | None = None


class ForwardStream:
    """The multiplexed stream to one replica (used from the client's event loop only)."""

    def __init__(self, stub, metadata: tuple[tuple[str, str], ...]) -> None:
        self._stub = stub
        self._metadata = metadata  # fixed for the stream's life: client metadata + token
        self._conn: _Conn | None = None  # the stream new calls go to
        self._retired: set[_Conn] = set()  # stalled streams, ending once their calls have
        self._ids = itertools.count(1)

    async def forward(self, request: pb.ForwardRequest, timeout: float) -> pb.ForwardResponse:
        """Send `request` (its request_id is overwritten) and wait for its answer."""
        request.request_id = rid = next(self._ids)
        deadline = time.monotonic() + timeout
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        conn = self._conn if self._conn is not None else self._open()
        conn.pending[rid] = answer
        conn.outbox.append((request, answer, deadline))
        conn.wake.set()
        # The deadline ends the answer itself (a timer, not wait_for's extra task and
        # futures): a request not written yet is then skipped by the writer, and one
        # whose call is cancelled (a sibling shard failed) too.
        timer = loop.call_later(timeout, _expire, answer)
        try:
            reply = await answer
        except _Expired:
            self._check_stalled(conn, timeout)
            raise StreamCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed") from None
        finally:
            timer.cancel()
            conn.pending.pop(rid, None)
            if conn in self._retired and not conn.pending:
                self._end(conn, grpc.StatusCode.CANCELLED, "retired stream drained")
        if reply.HasField("error"):
            code = _CODES.get(reply.error.code, grpc.StatusCode.UNKNOWN)
            raise StreamCallError(code, reply.error.message)
        return reply

    def _open(self) -> _Conn:
        conn = self._conn = _Conn(self._stub.ForwardStream(metadata=self._metadata))
        conn.reader = asyncio.ensure_future(self._read(conn))
        conn.writer = asyncio.ensure_future(self._write(conn))
        return conn

    async def _write(self, conn: _Conn) -> None:
        """Send the queued requests in order, skipping those whose call gave up."""
        try:
            while True:
                while not conn.outbox:
                    conn.wake.clear()
                    await conn.wake.wait()
                request, answer, deadline = conn.outbox.popleft()
                left = deadline - time.monotonic()
                if answer.done() or left <= 0:
                    continue
                request.timeout_us = max(int(left * 1e6), 1)  # the server drops it once passed
                await conn.call.write(request)
        except asyncio.CancelledError:
            raise
        except (grpc.RpcError, asyncio.InvalidStateError) as e:  # the stream is gone
            why = e.details() if isinstance(e, grpc.RpcError) else "stream already ended"
            self._end(conn, grpc.StatusCode.UNAVAILABLE, f"write failed: {why}")
        except Exception as e:  # e.g. a request that cannot be serialized: never a silent stall
            self._end(conn, grpc.StatusCode.INTERNAL, f"write failed: {e}", final=True)

    async def _read(self, conn: _Conn) -> None:
        code, why, final = grpc.StatusCode.UNAVAILABLE, "stream ended by the server", False
        try:
            async for reply in conn.call:
                if reply is None:  # grpc.aio's answer for bytes the deserializer refused
                    code, why, final = grpc.StatusCode.INTERNAL, "undecodable answer", True
                    break
                conn.last_answer = time.monotonic()
                answer = conn.pending.get(reply.request_id)
                if answer is not None and not answer.done():
                    answer.set_result(reply)
        except grpc.RpcError as e:
            code, why = e.code(), e.details()
        except asyncio.CancelledError:
            why = "stream closed by the client"
        except Exception as e:  # never leave calls waiting on a reader that died
            code, why, final = grpc.StatusCode.INTERNAL, f"reading answers failed: {e}", True
        self._end(conn, code, why, final)

    def _check_stalled(self, conn: _Conn, timeout: float) -> None:
        """Retire `conn` when it answered nothing for a whole call's timeout while
        calls waited on it (a wedged stream): new calls get a fresh one."""
        if conn.ended or conn is not self._conn or not conn.pending:
            return
        if time.monotonic() - conn.last_answer >= 0.9 * timeout:  # (timers fire a hair early)
            self._conn = None
            self._retired.add(conn)

    def _end(self, conn: _Conn, code: grpc.StatusCode, why: str, final: bool = False) -> None:
        """Fail every call waiting on `conn` and cancel it; the next call reopens.

        The status is UNAVAILABLE (retryable on another replica), except a refusal of
        our credentials and, when `final`, the server's own failure to speak the
        protocol (`code` as given)."""
        if conn.ended:
            return
        conn.ended = True
        if self._conn is conn:
            self._conn = None
        self._retired.discard(conn)
        conn.call.cancel()
        keep = final or code == grpc.StatusCode.UNAUTHENTICATED
        status = code if keep else grpc.StatusCode.UNAVAILABLE
        for answer in conn.pending.values():
            if not answer.done():
                answer.set_exception(StreamCallError(status, f"stream: {code.name}: {why}"))
                answer.exception()  # its waiter may have timed out: no "never retrieved" log
        conn.outbox.clear()
        me = asyncio.current_task()
        for task in (conn.reader, conn.writer):
            if task is not None and task is not me:
                task.cancel()

    def close(self) -> None:
        for conn in [self._conn, *self._retired]:
            if conn is not None:
                with contextlib.suppress(Exception):
                    self._end(conn, grpc.StatusCode.CANCELLED, "client closed")
