"""The client's side of the `tcp` data plane: slots reached over raw TCP connections
(the wire: expertd/rawtcp.py; the shard's side: server/tcpslots.py).

A lease: RegisterSlots over gRPC (with the client's credentials) answers with a
one-time token and the shard's data port; the client opens one connection per
slot to the host it reaches the shard's gRPC at, and presents the token and the
slot's index. The connections are the lease: closing them (or this process dying)
frees the slots on the shard, and one of them ending from the shard's side fails
the calls in flight with UNAVAILABLE, so the caller fails over as on gRPC.

A call: the routed rows go straight from the caller's tensors into the slot's
buffer (one gather), then one sendmsg of the header, x, ids and weights; the
answer's header and partial are read straight into the slot's buffers. The
caller's thread waits in poll() with the GIL released; on an event loop the
connection is watched by the loop while its call is in flight. The partial is
read where it lies until the caller releases the slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
import time

import grpc
import numpy as np

from expertd import dataplane as dp
from expertd import rawtcp
from expertd.client.shm import NO_TRACE, LeaseError, SlotPool, fill_rows, register_slots
from expertd.client.stream import StreamCallError

WAIT_SLICE_S = 0.02  # the caller's thread checks the lease's end this often
CONNECT_TIMEOUT_S = 3.0
# A call's bytes beyond what the kernel's buffers take at once are sent under the call's
# deadline (SO_SNDTIMEO): a shard that hangs stops reading and the send stops there.
SEND_TIMEOUT_ABOVE = 1 << 16
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class TcpSlot:
    """One slot: its connection and this client's buffers for it."""

    def __init__(self, lease: TcpLease, index: int, sock: socket.socket, layout: dp.Layout):
        self.lease = lease
        self.index = index
        self.sock = sock
        self.layout = layout
        self.buf = dp.host_buffer(layout.byte_size)
        h, k, mmax = layout.hidden, layout.top_k, layout.max_tokens
        self.x = self.buf[layout.x_offset : layout.x_offset + 2 * mmax * h].view(np.uint16)
        self.ids = self.buf[layout.ids_offset : layout.ids_offset + 4 * mmax * k].view(np.int32)
        self.w = self.buf[layout.weights_offset : layout.weights_offset + 4 * mmax * k].view(
            np.float32
        )
        self.out = self.buf[layout.out_offset : layout.out_offset + 2 * mmax * h].view(np.uint16)
        self._out_bytes = memoryview(self.buf[layout.out_offset : layout.out_offset + 2 * mmax * h])
        self._head = bytearray(rawtcp.ANSWER.size)
        self._error = bytearray(rawtcp.MAX_ERROR_BYTES)
        self.seq = 0
        self.rows = 0
        self.channel: TcpChannel | None = None
        self.held = False
        self.pending = False  # a call was sent and its answer not read yet
        self._answer = None  # (status, rows, timing, text) of the call `seq`
        # the answer being read: bytes of the header, then of the body, read so far
        self._got = 0
        self._body = 0
        self._body_view: memoryview | None = None

    def release(self) -> None:
        self.held = False
        if not self.lease.closed and self.channel is not None:
            self.channel.release(self)

    def idle(self) -> bool:
        """Answered everything sent: a call abandoned at its deadline keeps the slot
        out of use until its late answer has been read (and dropped) here."""
        if not self.pending:
            return True
        try:
            return self._pump()
        except StreamCallError:
            return False

    def start(
        self, layer, x_bits: np.ndarray, tokens, ids, w, timeout: float, notify, trace=NO_TRACE
    ):
        """Write one call's rows into the slot and send the call (see shm.Slot.start)."""
        m = fill_rows(self, x_bits, tokens, ids, w)
        k, h = ids.shape[1], self.layout.hidden
        self.rows = m
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        self._answer = None
        self._got = 0
        self._body_view = None
        head = rawtcp.CALL.pack(self.seq, layer, m, k, max(int(timeout * 1e6), 1), 0, *trace)
        parts = [head]
        if m:
            parts += [self.x[: m * h], self.ids[: m * k], self.w[: m * k]]
        self.pending = True
        try:
            if m * (2 * h + 8 * k) > SEND_TIMEOUT_ABOVE:  # a hung shard stops reading
                rawtcp.send_timeout(self.sock, timeout)
            rawtcp.send_all(self.sock, parts)
        except OSError as e:
            self.pending = False
            self.lease.ended(f"sending to the shard failed ({e})")
            raise self.lease.error() from None

    # -- reading the answer ---------------------------------------------------------------

    def _pump(self) -> bool:
        """Read what has arrived of the answer (non-blocking) -> True once it is whole.
        The lease ends (StreamCallError raised) at EOF, an error or a malformed answer."""
        if not self.pending:  # read whole already (or nothing sent): read no further
            return self._answer is not None
        sock = self.sock
        try:
            while True:
                if self._body_view is None:  # the header
                    n = sock.recv_into(
                        memoryview(self._head)[self._got :], flags=socket.MSG_DONTWAIT
                    )
                    if n == 0:
                        raise rawtcp.PeerGone("the shard closed the connection")
                    self._got += n
                    if self._got < len(self._head):
                        continue
                    seq, status, rows, error_len, *timing = rawtcp.ANSWER.unpack(self._head)
                    if seq != self.seq:
                        raise ValueError(f"answer to call {seq}, expected {self.seq}")
                    if status:
                        if error_len > rawtcp.MAX_ERROR_BYTES:
                            raise ValueError("error text too long")
                        self._body_view = memoryview(self._error)[:error_len]
                    else:
                        if rows > self.layout.max_tokens:
                            raise ValueError(f"{rows} rows exceed the slot")
                        self._body_view = self._out_bytes[: 2 * rows * self.layout.hidden]
                    self._answer = (
                        status,
                        rows,
                        dict(zip(dp.TIMING_FIELDS, timing, strict=True)),
                        "",
                    )
                    self._got = 0
                    self._body = len(self._body_view)
                if self._got < self._body:
                    n = sock.recv_into(self._body_view[self._got :], flags=socket.MSG_DONTWAIT)
                    if n == 0:
                        raise rawtcp.PeerGone("the shard closed the connection")
                    self._got += n
                    if self._got < self._body:
                        continue
                status, rows, timing, _ = self._answer
                text = bytes(self._body_view).decode("utf-8", "replace") if status else ""
                self._answer = (status, rows, timing, text)
                self._body_view = None
                self.pending = False
                return True
        except BlockingIOError:
            return False
        except (OSError, ValueError) as e:
            self.pending = False
            self.lease.ended(f"the shard's connection ended ({e})")
            raise self.lease.error() from None

    def answered(self) -> bool:
        return not self.pending and self._answer is not None

    def wait(self, deadline: float) -> bool:
        """Block until answered (True), the deadline (False) or the lease's end
        (StreamCallError UNAVAILABLE)."""
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        while True:
            if self.lease.closed:
                raise self.lease.error()
            if self._pump():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            poller.poll(max(min(left, WAIT_SLICE_S), 0) * 1000)

    async def wait_async(self, timeout: float) -> None:
        """The answer, read on the running loop as it arrives (StreamCallError on the
        deadline or the lease's end)."""
        if self._pump():
            return
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def readable() -> None:
            try:
                if self._pump() and not fut.done():
                    fut.set_result(None)
            except StreamCallError as e:
                if not fut.done():
                    fut.set_exception(e)

        fd = self.sock.fileno()
        loop.add_reader(fd, readable)
        self.lease.waiters[self.index] = (self.seq, fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise StreamCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed") from None
        finally:
            self.lease.waiters.pop(self.index, None)
            with contextlib.suppress(Exception):
                loop.remove_reader(fd)

    def result(self) -> np.ndarray:
        status, rows, _timing, text = self._answer
        if status:
            raise StreamCallError(_CODES.get(status, grpc.StatusCode.UNKNOWN), text)
        if rows != self.rows:
            raise StreamCallError(
                grpc.StatusCode.INTERNAL, f"shard answered {rows} rows, expected {self.rows}"
            )
        h = self.layout.hidden
        return self.out[: rows * h].reshape(rows, h)

    def timing(self) -> dict:
        return dict(self._answer[2]) if self._answer is not None else {}


class TcpLease:
    """One registration with one replica: its connections (one per slot)."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.lease_id = ""
        self.slots: list[TcpSlot] = []
        self.closed = False
        self.why = ""
        self.waiters: dict[int, tuple[int, asyncio.Future]] = {}
        self._lock = threading.Lock()

    def check_closed(self) -> bool:
        return self.closed

    def error(self) -> StreamCallError:
        return StreamCallError(grpc.StatusCode.UNAVAILABLE, f"tcp lease: {self.why}")

    def ended(self, why: str) -> None:
        """The lease is over (a connection ended, a call was abandoned): every
        connection closes, the calls in flight fail."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.why = why
        for slot in self.slots:
            with contextlib.suppress(OSError):
                slot.sock.shutdown(socket.SHUT_RDWR)
        for _seq, fut in list(self.waiters.values()):
            if not fut.done():
                with contextlib.suppress(RuntimeError):  # its loop closed
                    fut.get_loop().call_soon_threadsafe(_fail, fut, self.error())

    def close(self) -> None:
        self.ended("closed by the client")
        for slot in self.slots:
            with contextlib.suppress(OSError):
                slot.sock.close()


def _fail(fut: asyncio.Future, error: Exception) -> None:
    if not fut.done():
        fut.set_exception(error)
        fut.exception()


class TcpChannel(SlotPool):
    """Every tcp slot this client holds with one replica."""

    name = rawtcp.TCP

    def __init__(self, address: str, instance_id: str) -> None:
        super().__init__()
        self.address = address
        self.instance_id = instance_id
        self.host = rawtcp.host_of(address)
        self.calls = 0

    async def grow(self, stub, metadata, slots: int, timeout: float) -> None:
        """Lease `slots` more slots from the replica (LeaseError when it cannot be done)."""
        reply = await register_slots(stub, metadata, self, slots, timeout)
        lease = await asyncio.get_running_loop().run_in_executor(
            None, self._connect, reply, timeout
        )
        for slot in lease.slots:
            slot.channel = self
        with self._lock:
            self.leases.append(lease)
            self._free.extend(lease.slots)

    def _connect(self, reply, timeout: float) -> TcpLease:
        """One connection per slot, each presenting the token (blocking, off the loop)."""
        try:
            layout = dp.Layout.from_proto(reply.layout)
        except ValueError as e:
            raise LeaseError(str(e)) from None
        if not reply.data_port:
            raise LeaseError("the replica named no data port")
        lease = TcpLease(reply.instance_id)
        lease.lease_id = reply.lease_id
        try:
            for index in range(reply.slots):
                lease.slots.append(TcpSlot(lease, index, self._open(reply, index, timeout), layout))
        except BaseException:
            lease.close()
            raise
        return lease

    def _open(self, reply, index: int, timeout: float) -> socket.socket:
        where = (self.host, reply.data_port)
        try:
            sock = socket.create_connection(where, timeout=min(timeout, CONNECT_TIMEOUT_S))
        except OSError as e:  # a firewall, another network namespace, a port not exposed
            raise LeaseError(f"the shard's data port {where} is not reachable ({e})") from None
        try:
            rawtcp.tune(sock)
            sock.sendall(rawtcp.pack_hello(reply.token, index))
            answer = sock.recv(256)
            if answer[:1] != rawtcp.READY:
                why = answer[1:].decode(errors="replace") if answer else "connection closed"
                raise LeaseError(f"shard refused the tcp slot: {why}")
            sock.setblocking(True)
            return sock
        except OSError as e:
            sock.close()
            raise LeaseError(f"tcp slot handshake failed ({e})") from None
        except BaseException:
            sock.close()
            raise

    def close(self) -> None:
        with self._lock:
            leases, self.leases, self._free = self.leases, [], []
        for lease in leases:
            lease.close()
