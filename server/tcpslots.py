"""The shard's side of the `tcp` data plane: leases of slots reached over raw TCP
connections (the wire: expertd/rawtcp.py).

RegisterSlots (authenticated) books a lease: a one-time token and the number of
slots. Each slot is one TCP connection to this server's data port that presents
the token and its index; its thread then reads one call at a time straight into
the slot's buffers (x, ids, weights at a `dataplane.Layout`'s offsets), checks it
as Forward does (server/validate.py) and runs it on the batcher: on this thread
when the batcher is idle, queued on the event loop otherwise, where it batches
with every other call. The finisher copies the slot's rows into the slot's output
buffer (the runner's buffer is reused at once); on a GPU shard, a call past the
fused graphs' size has its rows copied by DMA straight between the slot's
page-locked buffers and the GPU instead (server/slots.py `PinnedRows`). This
thread sends the answer. A
client that stops reading stalls only its own connection, never the batcher: a
send that cannot finish within the receive timeout ends the lease.

A header that cannot be honoured (more rows or routes than the slot holds) is
answered with INVALID_ARGUMENT and ends the lease: the stream cannot be resynced.
One connection ending (the client closed it or died, the shard stops) ends every
connection of its lease; the client's calls in flight then fail with UNAVAILABLE.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from expertd import dataplane as dp
from expertd import rawtcp
from expertd.server.slots import PinnedRows, pin_device
from expertd.server.validate import invalid

log = logging.getLogger("expertd.server")

MAX_SLOTS_PER_LEASE = 16
MAX_CONNECTIONS = 1024  # slot connections held at once, all leases together
PENDING_TTL_S = 30.0  # a registration's connections must all arrive within this
HANDSHAKE_TIMEOUT_S = 5.0
IDLE_SLICE_S = 1.0  # a connection waiting for its next call checks its lease this often


@dataclass(slots=True)
class _Pending:
    lease_id: str
    layout: dp.Layout
    slots: int
    created: float
    claimed: set = field(default_factory=set)
    lease: TcpLease | None = None


class TcpSlot:
    """One slot: its connection, its buffers, its thread. The batcher's sink."""

    def __init__(
        self, lease: TcpLease, index: int, conn: socket.socket, layout: dp.Layout, pin=None
    ):
        self.lease = lease
        self.index = index
        self.conn = conn
        self.layout = layout
        self.buf = dp.host_buffer(layout.byte_size)  # pages appear once written
        mmax, k, h = layout.max_tokens, layout.top_k, layout.hidden
        self._x = self.buf[layout.x_offset : layout.x_offset + 2 * mmax * h]
        self._ids = self.buf[layout.ids_offset : layout.ids_offset + 4 * mmax * k]
        self._w = self.buf[layout.weights_offset : layout.weights_offset + 4 * mmax * k]
        self._out = self.buf[layout.out_offset : layout.out_offset + 2 * mmax * h]
        # A GPU shard: the rows its calls use are page-locked on demand, for DMA.
        self._pins = None
        if pin is not None:
            out = torch.from_numpy(self._out.view(np.int16)).view(torch.bfloat16)
            self._pins = PinnedRows(self.buf.ctypes.data, layout, pin, out)
        self._ended = False  # the connection's thread is done: unlock once answered
        self.lock = threading.Lock()
        self.busy = False
        self.seq = 0
        self.ready = threading.Event()  # the answer of call `seq` is written
        self._answer = b""  # its header
        self._rows_bytes = 0  # its partial's bytes in _out (0 for an error)
        self._error = b""

    def inputs(self, m: int, k: int, hidden: int):
        """The call's tensors, viewing the slot's buffers (read there by the forward;
        this thread reads no next call until the answer is sent)."""
        if m == 0:
            return (
                torch.empty((0, hidden), dtype=torch.bfloat16),
                torch.empty((0, max(k, 1)), dtype=torch.int32),
                torch.empty((0, max(k, 1)), dtype=torch.float32),
            )
        x = torch.from_numpy(self._x[: 2 * m * hidden]).view(torch.bfloat16).view(m, hidden)
        ids = torch.from_numpy(self._ids[: 4 * m * k]).view(torch.int32).view(m, k)
        w = torch.from_numpy(self._w[: 4 * m * k]).view(torch.float32).view(m, k)
        return x, ids, w

    @property
    def direct(self) -> bool:
        """Whether the runner may copy this slot's rows straight to and from the GPU."""
        return self._pins is not None and not self._pins.refused

    def device_out(self, m: int) -> torch.Tensor | None:
        """The output buffer's first m rows (bf16 [m, H]) once x's and out's first m
        rows are page-locked, for the runner to copy into; None when the rows come
        through `write_output` (a CPU shard, or the driver refused the lock)."""
        return None if self._pins is None else self._pins.out_rows(m)

    def end(self) -> None:
        """The connection's thread is done: unlock the rows now, or once the call in
        flight is answered (its copies may still be queued)."""
        with self.lock:
            self._ended = True
            if not self.busy:
                self._unlock()

    def _unlock(self) -> None:
        if self._pins is not None:
            self._pins.release()
            self._pins = None

    # -- the batcher's sink (any thread) -----------------------------------------------

    def write_output(self, rows, timing: dict, placed: bool = False) -> None:
        """The partial (uint8 [m, 2H] bf16 bits; `placed`: the runner copied it into
        `device_out` already) into the output buffer, then OK."""
        with self.lock:
            if not self.busy:
                return
            data = np.asarray(rows).reshape(-1)
            n = data.shape[0]
            if not placed:
                self._out[:n] = data
            self._rows_bytes = n
            rows_n = n // (2 * self.layout.hidden)
            values = [int(timing.get(name, 0)) for name in dp.TIMING_FIELDS]
            self._answer = rawtcp.ANSWER.pack(self.seq, 0, rows_n, 0, *values)
            self._error = b""
            self.busy = False
            if self._ended:
                self._unlock()
            self.ready.set()

    def write_error(self, code: grpc.StatusCode, message: str) -> None:
        with self.lock:
            if not self.busy:
                return
            text = message.encode("utf-8", "replace")[: rawtcp.MAX_ERROR_BYTES]
            zeros = [0] * len(dp.TIMING_FIELDS)
            self._answer = rawtcp.ANSWER.pack(self.seq, code.value[0], 0, len(text), *zeros)
            self._error = text
            self._rows_bytes = 0
            self.busy = False
            if self._ended:
                self._unlock()
            self.ready.set()

    def begin(self, seq: int) -> None:
        with self.lock:
            self.busy, self.seq = True, seq
            self.ready.clear()

    def send_answer(self) -> None:
        """The written answer, on this slot's connection (its own thread)."""
        body = self._error if self._error else self._out[: self._rows_bytes]
        rawtcp.send_all(self.conn, [self._answer, body])


class TcpLease:
    """One registration's slots; any of its connections ending ends them all."""

    def __init__(self, registry: TcpRegistry, lease_id: str, layout: dp.Layout, slots: int):
        self.registry = registry
        self.lease_id = lease_id
        self.layout = layout
        self.slots: list[TcpSlot | None] = [None] * slots
        self.peer = ""
        self.closed = False
        self.transport = rawtcp.TCP
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            slots = [s for s in self.slots if s is not None]
        for slot in slots:
            with contextlib.suppress(OSError):
                slot.conn.shutdown(socket.SHUT_RDWR)
        self.registry._dropped(self)


class TcpRegistry:
    """Every tcp lease of one server: its listening socket and its threads."""

    def __init__(
        self, servicer, host: str, port: int, receive_timeout_s: float = 30.0, pin: bool = True
    ):
        self.servicer = servicer
        self.pin = pin  # page-lock a GPU shard's slot rows for its copies (PinnedRows)
        self.receive_timeout_s = receive_timeout_s
        self._pending: dict[bytes, _Pending] = {}
        self.leases: dict[str, TcpLease] = {}
        self._connections = 0
        self._lock = threading.Lock()
        self._closed = False
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, _, _, _, where = infos[0]
        self._sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind(where)
        except OSError as e:
            self._sock.close()
            raise OSError(f"tcp data plane: could not bind port {port} on {host!r}: {e}") from None
        self._sock.listen(256)
        self.port = self._sock.getsockname()[1]
        self._accepter = threading.Thread(
            target=self._accept_loop, name="expertd-tcp-slots", daemon=True
        )
        self._accepter.start()

    # -- registration (on the event loop) -----------------------------------------------

    def book(self, slots: int, max_tokens: int, top_k: int, hidden: int):
        """A pending lease -> (token, lease id, layout). RequestError on a bad ask."""
        limits = self.servicer.limits
        slots = slots or 1
        if not 1 <= slots <= MAX_SLOTS_PER_LEASE:
            raise invalid(f"slots {slots} outside [1, {MAX_SLOTS_PER_LEASE}]")
        max_tokens = max_tokens or limits.max_tokens
        if max_tokens > limits.max_tokens:
            raise invalid(
                f"max_tokens {max_tokens}: this server accepts at most {limits.max_tokens}"
            )
        top_k = top_k or limits.max_top_k
        if not 1 <= top_k <= limits.max_top_k:
            raise invalid(f"top_k {top_k} outside [1, {limits.max_top_k}]")
        token = secrets.token_bytes(rawtcp.TOKEN_BYTES)
        lease_id = secrets.token_hex(8)
        layout = dp.Layout(max_tokens, top_k, hidden)
        now = time.monotonic()
        with self._lock:
            for key in [k for k, p in self._pending.items() if now - p.created > PENDING_TTL_S]:
                del self._pending[key]
            self._pending[token] = _Pending(lease_id, layout, slots, now)
        return token, lease_id, layout

    # -- connections ---------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # out of fds, most likely: try again shortly
                continue
            with self._lock:
                full = self._connections >= MAX_CONNECTIONS
                if not full:
                    self._connections += 1
            if full:
                log.warning(
                    "tcp data plane: %d connections open, refusing %s", MAX_CONNECTIONS, peer
                )
                conn.close()
                continue
            threading.Thread(
                target=self._serve, args=(conn, peer), name="expertd-tcp-slot", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        slot = None
        try:
            try:
                slot = self._handshake(conn)
            except (OSError, ValueError) as e:
                log.info("tcp slot from %s refused: %s", peer, e)
                with contextlib.suppress(OSError):
                    conn.sendall(rawtcp.REFUSED + str(e).encode()[:200])
                return
            self._calls(slot)
        except (OSError, rawtcp.PeerGone):
            pass
        except Exception:
            log.exception("tcp slot connection failed")
        finally:
            if slot is not None:
                slot.lease.close()
                slot.end()
            conn.close()
            with self._lock:
                self._connections -= 1

    def _handshake(self, conn: socket.socket) -> TcpSlot:
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        hello = bytearray(rawtcp.HELLO.size)
        rawtcp.recv_into(conn, memoryview(hello))
        token, index = rawtcp.unpack_hello(bytes(hello))
        with self._lock:
            if self._closed:
                raise ValueError("server is stopping")
            pending = self._pending.get(token)
            if pending is None or time.monotonic() - pending.created > PENDING_TTL_S:
                raise ValueError("unknown or expired registration token")
            if index >= pending.slots or index in pending.claimed:
                raise ValueError(f"slot index {index} is not open in this registration")
            pending.claimed.add(index)
            if pending.lease is None:
                pending.lease = TcpLease(self, pending.lease_id, pending.layout, pending.slots)
            lease = pending.lease
            if len(pending.claimed) == pending.slots:
                del self._pending[token]
            if lease.closed:
                raise ValueError("the lease ended during registration")
            slot = TcpSlot(lease, index, conn, pending.layout, pin_device(self.servicer, self.pin))
            lease.slots[index] = slot
            new = lease.lease_id not in self.leases
            self.leases[lease.lease_id] = lease
        rawtcp.tune(conn)
        conn.sendall(rawtcp.READY)
        metrics = self.servicer.metrics
        if new:
            host, port = conn.getpeername()[:2]
            lease.peer = f"{host}:{port}"
            metrics.dataplane_leases.labels(rawtcp.TCP).inc()
        metrics.dataplane_slots.labels(rawtcp.TCP).inc()
        return slot

    def _calls(self, slot: TcpSlot) -> None:
        """Read, check and run one call at a time; send each answer."""
        conn, lay, lease = slot.conn, slot.layout, slot.lease
        head = bytearray(rawtcp.CALL.size)
        head_view = memoryview(head)
        x_view, ids_view, w_view = memoryview(slot._x), memoryview(slot._ids), memoryview(slot._w)
        h = lay.hidden
        while not lease.closed:
            conn.settimeout(IDLE_SLICE_S)
            try:  # the next call's first bytes: an idle lease waits here
                got = conn.recv_into(head_view)
            except TimeoutError:
                continue
            if got == 0:
                return
            conn.settimeout(self.receive_timeout_s)  # the rest must follow promptly
            if got < len(head):
                rawtcp.recv_into(conn, head_view[got:])
            seq, layer, m, k, timeout_us, rid, *trace = rawtcp.CALL.unpack(head)
            received = time.perf_counter_ns()
            slot.begin(seq)
            if m > lay.max_tokens or (m and not 1 <= k <= lay.top_k):
                why = (
                    f"m = {m} rows exceed the slot's {lay.max_tokens}"
                    if m > lay.max_tokens
                    else f"top_k {k} outside the slot's [1, {lay.top_k}]"
                )
                self.servicer.count_slot(grpc.StatusCode.INVALID_ARGUMENT)
                slot.write_error(grpc.StatusCode.INVALID_ARGUMENT, why + " (lease ended)")
                slot.send_answer()
                return  # the call's bytes cannot be skipped safely: the lease ends
            if m:
                rawtcp.recv_into(conn, x_view[: 2 * m * h])
                rawtcp.recv_into(conn, ids_view[: 4 * m * k])
                rawtcp.recv_into(conn, w_view[: 4 * m * k])
            self.servicer.take_slot_call(
                slot,
                lease.lease_id,
                self._take,
                slot,
                layer,
                m,
                k,
                timeout_us,
                rid,
                received,
                trace,
            )
            while not slot.ready.wait(IDLE_SLICE_S):
                if lease.closed:
                    return
            slot.send_answer()

    def _take(self, slot: TcpSlot, layer, m, k, timeout_us, rid, received, trace) -> None:
        bank = self.servicer.admit()
        x, ids, w = slot.inputs(m, k, slot.layout.hidden)
        self.servicer.run_slot_call(slot, bank, layer, x, ids, w, timeout_us, rid, received, trace)

    def _dropped(self, lease: TcpLease) -> None:
        with self._lock:
            gone = self.leases.pop(lease.lease_id, None)
            for key in [k for k, p in self._pending.items() if p.lease is lease]:
                del self._pending[key]
        if gone is not None:
            metrics = self.servicer.metrics
            metrics.dataplane_leases.labels(rawtcp.TCP).dec()
            metrics.dataplane_slots.labels(rawtcp.TCP).dec(sum(s is not None for s in lease.slots))
            log.debug("tcp slot lease %s ended (%s)", lease.lease_id, lease.peer)

    def close(self) -> None:
        """Stop accepting and end every lease (clients see their connections close)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            leases = list(self.leases.values())
        for lease in leases:
            lease.close()

    def stats(self) -> dict:
        with self._lock:
            return {
                lid: {
                    "peer": lease.peer,
                    "slots": sum(s is not None for s in lease.slots),
                    "transport": rawtcp.TCP,
                }
                for lid, lease in self.leases.items()
            }
