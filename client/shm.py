"""The client's side of the same-host data plane (`shm`): slots leased from one shard
replica, filled and rung from the caller's thread or the event loop.

A lease (expertd/dataplane.py, docs/dataplane.md): RegisterSlots over gRPC (with the
client's credentials) names the shard's abstract unix socket and a one-time token;
the client connects, presents the token, receives the slots' memfds, maps them,
writes a nonce into each slot's control block and sends the nonces back; READY
means the shard reads the same memory. The socket stays open for the lease's
life: closing it (or this process dying) frees the slots on the shard, and its
end (the shard stopped or died) fails the calls in flight at once, with
UNAVAILABLE, so the caller fails over as on the gRPC path.

A call: the routed rows go straight from the caller's tensors into the slot's input
regions (one gather), the header, req_seq + 1, FUTEX_WAKE. The answer is waited for
either on the calling thread (spin briefly, then FUTEX_WAIT with the GIL released)
or, on an event loop, by asking the shard to also send DONE on the socket, which the
loop watches. The partial is read where it lies (a view of the output region) until
the caller releases the slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
import os
import secrets
import select
import socket
import struct
import threading
import time

import grpc
import numpy as np

from expertd import dataplane as dp
from expertd.client.stream import StreamCallError
from expertd.tracing import NO_CONTEXT

# The caller's wait: spin this long on resp_seq before sleeping in FUTEX_WAIT. A forward
# takes tens of microseconds at least; spinning for about that long saves the wake-up of
# a sleeping thread (several microseconds, more on a busy machine) without holding a core.
SPIN_S = 30e-6
# A slot whose answers take longer than SLEEP_FIRST_S (a CPU shard, a large call) is not
# spun on right after the ring: the shard's waiter is woken on this CPU as often as not,
# and a spinning caller keeps it from running there (measured on the 2-core machine: the
# shard saw the doorbell 30 - 65 us later when the caller spun). The caller sleeps instead
# until SPIN_EARLY_S before the answer is due (the shortest of the slot's recent answer
# times: answers jitter by more than SPIN_EARLY_S, and an answer that comes while the
# caller sleeps costs a wake-up, 80 us on the 2-core machine), then spins for it, at most
# SPIN_EARLY_S + SPIN_S, then sleeps again until it comes.
# In a process with spare CPUs (dp.spare_cpus) the caller also spins through its answers'
# recent jitter (the longest minus the shortest answer time, at most SPIN_JITTER_S), and
# right after the ring for as long as its recent answers took, if under SLEEP_FIRST_S.
SLEEP_FIRST_S = 150e-6
SPIN_EARLY_S = 80e-6
SPIN_JITTER_S = 500e-6
EOF_CHECK_S = 0.02  # while sleeping, how often the lease socket is checked for its end
MAX_SLOTS = 8  # slots per replica: calls beyond this many at once use gRPC
SLOTS_PER_LEASE = 2
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class LeaseError(Exception):
    """The data plane could not be set up with a replica (not on this host, refused...)."""


NO_TRACE = NO_CONTEXT  # a call without the caller's span


def write_trace(ctl, trace) -> None:
    """The caller's span (trace_hi, trace_lo, span_id, flags) into a control block;
    span_id 0 says there is none (one store for an untraced call)."""
    ctl.span_id = trace[2]
    if trace[2]:
        ctl.trace_hi, ctl.trace_lo, ctl.trace_flags = trace[0], trace[1], trace[3]


def fill_rows(slot, x_bits: np.ndarray, tokens, ids, w) -> int:
    """Write one call's rows into a slot's regions (any slot transport: `layout`,
    `x`, `ids`, `w` views) -> m. x_bits: uint16 [M, H] (the call's rows), tokens:
    the rows of it to send (None: all, in order), ids/w: [m, k]."""
    m, k = ids.shape
    lay = slot.layout
    lay.check(m, k)
    h = lay.hidden
    if m:
        dst = slot.x[: m * h].reshape(m, h)
        if tokens is None:
            dst[:] = x_bits
        else:
            np.take(x_bits, tokens, axis=0, out=dst)
        slot.ids[: m * k] = ids.reshape(-1)
        slot.w[: m * k] = w.reshape(-1)
    return m


class Slot:
    """One slot as this process maps it."""

    def __init__(self, lease: Lease, index: int, fd: int, layout: dp.Layout) -> None:
        self.lease = lease
        self.index = index
        self.layout = layout
        self.mm = mmap.mmap(fd, layout.byte_size)
        self.ctl = dp.Control.from_buffer(self.mm)
        base = ctypes.addressof(self.ctl)
        self.req_addr = base + dp.Control.req_seq.offset
        self.resp_addr = base + dp.Control.resp_seq.offset
        h, k, mmax = layout.hidden, layout.top_k, layout.max_tokens
        buf = np.frombuffer(self.mm, np.uint8)
        self.x = buf[layout.x_offset : layout.x_offset + 2 * mmax * h].view(np.uint16)
        self.ids = buf[layout.ids_offset : layout.ids_offset + 4 * mmax * k].view(np.int32)
        self.w = buf[layout.weights_offset : layout.weights_offset + 4 * mmax * k].view(np.float32)
        self.out = buf[layout.out_offset : layout.out_offset + 2 * mmax * h].view(np.uint16)
        self.seq = 0
        self.rows = 0  # rows of the call in flight / last answered
        self.ring_ns = 0  # time.monotonic_ns() of the last ring
        self.took = dp.Recent()  # how long answers take: ring -> seen answered
        self.channel: ShmChannel | None = None
        self.held = False  # taken by a call (its answer may still be read)

    def release(self) -> None:
        """Back to its channel's free slots (taken again only once idle); unmapped
        instead when its lease has ended meanwhile."""
        self.held = False
        if self.lease.closed:
            self.unmap()
        elif self.channel is not None:
            self.channel.release(self)

    def idle(self) -> bool:
        """The shard has answered everything rung (a call abandoned at its deadline
        keeps the slot out of use until then)."""
        return self.ctl.resp_seq == self.ctl.req_seq

    def start(
        self,
        layer: int,
        x_bits: np.ndarray,
        tokens,
        ids,
        w,
        timeout: float,
        notify: bool,
        ring: bool = True,
        trace=NO_TRACE,
    ):
        """Write one call's rows and header; ring (or leave that to `ring()`). x_bits:
        uint16 [M, H] (the call's rows), tokens: the rows of it to send (None: all, in
        order), ids/w: [m, k]; trace: the caller's span (tracing.context_fields)."""
        m = fill_rows(self, x_bits, tokens, ids, w)
        k = ids.shape[1]
        ctl = self.ctl
        ctl.layer = layer
        ctl.m = m
        ctl.k = k
        ctl.flags = dp.FLAG_NOTIFY if notify else 0
        ctl.timeout_us = max(int(timeout * 1e6), 1)
        write_trace(ctl, trace)
        self.rows = m
        if ring:
            self.ring()

    def ring(self) -> None:
        """The doorbell of the call written by `start`."""
        ctl = self.ctl
        self.seq = (ctl.req_seq + 1) & 0xFFFFFFFF
        ctl.seen_ns = 0  # the shard's, for this call (an older shard leaves it 0)
        self.ring_ns = time.monotonic_ns()
        ctl.req_seq = self.seq  # after the data: the shard reads it only once it sees this
        self.wake()

    def wake(self) -> None:
        """Wake the shard's waiter, should it sleep (FUTEX_WAKE on req_seq)."""
        dp.futex_wake(self.req_addr)

    def answered(self) -> bool:
        return self.ctl.resp_seq == self.seq

    def wait(self, deadline: float) -> bool:
        """Block the calling thread until answered (True), the deadline (False), or
        the lease's end (StreamCallError UNAVAILABLE)."""
        ctl, old = self.ctl, (self.seq - 1) & 0xFFFFFFFF
        spin = SPIN_S
        early, late = self.took.low(), self.took.high()
        if early > SLEEP_FIRST_S and ctl.resp_seq == old:
            due = self.ring_ns / 1e9 + early - SPIN_EARLY_S
            if time.monotonic() < due:  # asleep until shortly before the answer is due
                dp.wait_word(ctl, "resp_seq", self.resp_addr, old, min(due, deadline), 0.0)
            spin = SPIN_EARLY_S + SPIN_S
            if dp.spare_cpus():
                spin += min(late - early, SPIN_JITTER_S)
        elif dp.spare_cpus():
            spin = min(late, early + SPIN_JITTER_S) + SPIN_S
        while True:
            now = time.monotonic()
            until = min(deadline, now + EOF_CHECK_S)
            if dp.wait_word(ctl, "resp_seq", self.resp_addr, old, until, spin):
                if self.answered():
                    self.took.add(time.monotonic() - self.ring_ns / 1e9)
                    return True
                old = ctl.resp_seq  # an answer to an older, abandoned call
                continue
            if self.lease.check_closed():
                raise self.lease.error()
            if time.monotonic() >= deadline:
                return False

    def checked_rows(self) -> int:
        """The answered call's rows; raises StreamCallError with the shard's status when
        the call failed."""
        ctl = self.ctl
        if ctl.status:
            code = _CODES.get(ctl.status, grpc.StatusCode.UNKNOWN)
            raise StreamCallError(code, self.error_text())
        if ctl.out_rows != self.rows:
            raise StreamCallError(
                grpc.StatusCode.INTERNAL,
                f"shard answered {ctl.out_rows} rows, expected {self.rows}",
            )
        return self.rows

    def error_text(self) -> str:
        """The text of the last error the shard answered in this slot."""
        n = min(self.ctl.error_len, dp.ERROR_BYTES)
        return bytes(self.mm[dp.ERROR_OFFSET : dp.ERROR_OFFSET + n]).decode("utf-8", "replace")

    def result(self) -> np.ndarray:
        """The answer: bf16 bits uint16 [rows, H] viewing the output region; raises
        StreamCallError with the shard's status when the call failed."""
        rows, h = self.checked_rows(), self.layout.hidden
        return self.out[: rows * h].reshape(rows, h)

    def timing(self) -> dict:
        """The shard's Timing of the answered call, and (when it stamped the call) the
        two wake-ups: `doorbell_us`, the ring -> the shard's waiter running, and
        `wake_us`, the shard's answer -> now (the caller has just seen it)."""
        ctl = self.ctl
        out = {name: getattr(ctl, name) for name in dp.TIMING_FIELDS}
        seen, answered = ctl.seen_ns, ctl.answered_ns
        now = time.monotonic_ns()
        if self.ring_ns <= seen <= answered <= now:
            out["doorbell_us"] = (seen - self.ring_ns) / 1000
            out["wake_us"] = (now - answered) / 1000
        return out

    def unmap(self) -> None:
        if self.ctl is None:
            return
        self.x = self.ids = self.w = self.out = None
        self.ctl = None
        with contextlib.suppress(BufferError):  # a caller's view still alive: GC unmaps
            self.mm.close()


class Lease:
    """One lease: the socket that holds it and its slots."""

    def __init__(self, sock: socket.socket, lease_id: str, instance_id: str) -> None:
        self.sock = sock
        self.lease_id = lease_id
        self.instance_id = instance_id
        self.slots: list[Slot] = []
        self.closed = False
        self.why = ""
        self.waiters: dict[int, tuple[int, asyncio.Future]] = {}  # slot -> (seq, future)
        self._loop: asyncio.AbstractEventLoop | None = None

    def check_closed(self) -> bool:
        """Has the shard's end gone (EOF or an error on the socket)?"""
        if self.closed:
            return True
        with contextlib.suppress(OSError, ValueError):
            r, _, _ = select.select([self.sock], [], [], 0)
            if r:
                try:
                    data = self.sock.recv(64, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return False
                if not data:
                    self._ended("the shard closed the lease (stopped or restarted)")
        return self.closed

    def error(self) -> StreamCallError:
        return StreamCallError(grpc.StatusCode.UNAVAILABLE, f"shm lease: {self.why}")

    def _ended(self, why: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.why = why
        for _seq, fut in self.waiters.values():
            if not fut.done():
                fut.get_loop().call_soon_threadsafe(_fail, fut, self.error())

    # -- notifications on an event loop ---------------------------------------------------

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read DONE messages and the socket's end on `loop` (from the loop's thread)."""
        self._loop = loop
        self.sock.setblocking(False)
        loop.add_reader(self.sock.fileno(), self._readable)

    def _readable(self) -> None:
        while True:
            try:
                msg = self.sock.recv(64)
            except BlockingIOError:
                return
            except OSError as e:
                msg, why = b"", f"socket error: {e}"
            else:
                why = "the shard closed the lease (stopped or restarted)"
            if not msg:
                self._unwatch()
                self._ended(why)
                return
            if msg[:1] == dp.DONE and len(msg) >= 5:
                index = dp.unpack_u32(msg[1:5])
                entry = self.waiters.get(index)
                if (
                    entry is not None
                    and self.slots[index].ctl.resp_seq == entry[0]
                    and not entry[1].done()
                ):
                    entry[1].set_result(None)

    def _unwatch(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.sock.fileno())
        self._loop = None

    def close(self) -> None:
        """End the lease: the shard frees the slots when the socket closes."""
        self._ended("closed by the client")
        self._unwatch()
        with contextlib.suppress(OSError):
            self.sock.close()
        for slot in self.slots:
            if not slot.held:  # a held one: when its call lets go of it (Slot.release)
                slot.unmap()


def _fail(fut: asyncio.Future, error: Exception) -> None:
    if not fut.done():
        fut.set_exception(error)
        fut.exception()  # its waiter may have gone: no "never retrieved" log


class SlotPool:
    """The slots a client holds with one replica, over any slot transport: a
    thread-safe hand-out of idle slots, and whether the replica's leases still hold.
    Subclasses fill `leases` (each with `slots`, `closed`, `why`) and `_free`."""

    # the rows a slot holds, asked for when leasing (0: the replica's limit; the client's
    # slot_tokens); set before the first lease
    slot_tokens = 0

    def __init__(self) -> None:
        self.leases: list = []
        self._free: list = []
        self._lock = threading.Lock()
        self.broken = ""  # why this channel is unusable (set once a lease ended)

    @property
    def size(self) -> int:
        return sum(len(lease.slots) for lease in self.leases)

    @property
    def rows(self) -> int:
        """The rows one slot holds (0 before the first lease)."""
        for lease in self.leases:
            if lease.slots:
                return lease.slots[0].layout.max_tokens
        return 0

    def fits(self, rows: int) -> bool:
        """Whether a call of `rows` rows fits this replica's slots (the leases made so
        far; before the first, whether it fits what will be asked for)."""
        if self.rows:
            return rows <= self.rows
        return not self.slot_tokens or rows <= self.slot_tokens

    def acquire(self):
        """A free slot, or None (all busy or abandoned)."""
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):
                slot = self._free[i]
                if slot.lease.closed:
                    del self._free[i]
                elif slot.idle():
                    slot.held = True
                    return self._free.pop(i)
        return None

    def release(self, slot) -> None:
        with self._lock:
            if not slot.lease.closed:
                self._free.append(slot)

    def usable(self) -> bool:
        if self.broken:
            return False
        for lease in self.leases:
            if lease.closed:
                self.broken = lease.why or "lease ended"
                return False
        return True


class ShmChannel(SlotPool):
    """Every slot this client holds with one replica; thread-safe hand-out."""

    name = dp.SHM
    on_device = False  # cuda-ipc (client/cudaipc.py): x and out in the shard's GPU memory

    def __init__(self, address: str, instance_id: str) -> None:
        self.address = address
        self.instance_id = instance_id
        super().__init__()
        self.calls = 0

    async def grow(self, stub, metadata, slots: int, timeout: float, keep: bool = False) -> list:
        """Lease `slots` more slots from the replica (LeaseError when it cannot be done)
        -> them. `keep`: held for the caller from now on (never handed out; calls
        captured in CUDA graphs, client/onstream.py), not added to the free ones."""
        reply = await register_slots(stub, metadata, self, slots, timeout)
        lease = await asyncio.get_running_loop().run_in_executor(None, _claim, reply, timeout, self)
        lease.watch(asyncio.get_running_loop())
        for slot in lease.slots:
            slot.channel = self
            slot.held = keep
        with self._lock:
            self.leases.append(lease)
            if not keep:
                self._free.extend(lease.slots)
        return list(lease.slots)

    def map_slots(self, sock: socket.socket, lease: Lease, fds, layout: dp.Layout) -> None:
        """Map the lease's slots into this process (blocking, on the lease's socket
        thread); a transport whose slots hold more than host memory reads more here."""
        lease.slots.extend(Slot(lease, i, fd, layout) for i, fd in enumerate(fds))

    def close(self) -> None:
        with self._lock:
            leases, self.leases, self._free = self.leases, [], []
        for lease in leases:
            lease.close()


async def register_slots(stub, metadata, channel, slots: int, timeout: float):
    """RegisterSlots for `slots` slots of `channel`'s transport with its replica -> the
    reply (LeaseError when refused, or when the replica restarted meanwhile)."""
    from expertd.v1 import expertd_pb2 as pb

    try:
        reply = await stub.RegisterSlots(
            pb.RegisterSlotsRequest(
                transport=channel.name, slots=slots, max_tokens=channel.slot_tokens
            ),
            timeout=timeout,
            metadata=metadata,
        )
    except grpc.RpcError as e:
        raise LeaseError(f"RegisterSlots: {e.code().name}: {e.details()}") from None
    if reply.instance_id != channel.instance_id:
        raise LeaseError("the replica restarted while registering")
    return reply


def _claim(reply, timeout: float, channel: ShmChannel) -> Lease:
    """The socket side of registering (blocking, off the event loop); `channel` maps
    the slots (a cuda-ipc lease's x and out regions are the shard's GPU memory)."""
    try:
        layout = dp.Layout.from_proto(reply.layout, device=channel.on_device)
    except ValueError as e:
        raise LeaseError(str(e)) from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(min(timeout, 5.0))
    lease = None
    try:
        try:
            sock.connect(dp.abstract_address(reply.socket_name))
        except OSError as e:  # another host, or another network namespace
            raise LeaseError(f"the shard's unix socket is not reachable from here ({e})") from None
        sock.send(dp.HELLO + reply.token)
        msg, fds, _flags, _addr = socket.recv_fds(sock, 256, reply.slots + 1)
        try:
            if msg[:1] == dp.REFUSED:
                raise LeaseError(f"shard refused the lease: {msg[1:].decode(errors='replace')}")
            if msg[:1] != dp.FDS or len(fds) != reply.slots:
                raise LeaseError("malformed answer on the lease socket")
            lease = Lease(sock, msg[1:].decode(), reply.instance_id)
            for fd in fds:
                if not dp.is_sealed(fd) or os.fstat(fd).st_size < layout.byte_size:
                    raise LeaseError("slot memory is not sealed at its size")
            channel.map_slots(sock, lease, fds, layout)
        finally:
            for fd in fds:
                os.close(fd)
        nonces = [secrets.randbits(63) | 1 for _ in lease.slots]
        for slot, nonce in zip(lease.slots, nonces, strict=True):
            slot.ctl.nonce = nonce
            if channel.on_device:
                slot.write_proof(nonce)
        sock.send(dp.PROOF + b"".join(struct.pack("<Q", n) for n in nonces))
        answer = sock.recv(256)
        if answer[:1] != dp.READY:
            why = answer[1:].decode(errors="replace") if answer[:1] == dp.REFUSED else "no answer"
            raise LeaseError(f"shard refused the mapping proof: {why}")
        return lease
    except BaseException:
        if lease is not None:
            lease.close()
        else:
            sock.close()
        raise
    finally:
        if lease is not None and not lease.closed:
            sock.settimeout(None)
