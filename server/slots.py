"""The shard's side of the same-host data plane: leases of shared-memory slots.

RegisterSlots (an authenticated RPC) books a lease and answers with the name of
this server's unix socket (Linux abstract namespace: reaching it proves the
caller is on this host and in this network namespace) and a one-time token.
The caller connects, presents the token and receives one sealed memfd per slot
(SCM_RIGHTS); it writes a nonce into each slot's control block and sends the
nonces back, which proves its mapping and ours are the same memory. From then
on the connection is the lease: when it closes (the client closed it, or its
process died and the kernel closed it) the slots are freed at once.

Each slot has a waiter thread: asleep in FUTEX_WAIT on the control block's
req_seq until the client rings, it reads the call's header, checks it (the
region's bounds, the layer, the tensors: the same checks and errors as Forward)
and hands the call, as tensors viewing the slot's input regions, to the event
loop, which admits it and queues it on the batcher like any Forward. The batch's
finisher writes the slot's rows of the output straight into the slot's output
region, then the status and timing, stores resp_seq and wakes the client
(server/batcher.py: Job.sink). An error is written the same way, with its code
and message. A slot serves one call at a time: its waiter takes the next
doorbell only once the current call has been answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import mmap
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from expertd import cudamem, tracing
from expertd import dataplane as dp
from expertd.server.validate import RequestError, invalid

log = logging.getLogger("expertd.server")

MAX_SLOTS_PER_LEASE = 16
PENDING_TTL_S = 30.0  # a registration not claimed on the socket within this is dropped
HANDSHAKE_TIMEOUT_S = 5.0
# How long a waiter spins on req_seq before sleeping in FUTEX_WAIT. A shard waits far more
# than it works; spinning would take a core from the client and from the other shards.
WAIT_SPIN_S = 0.0
# A slot whose calls come at a steady pace (a decode loop: one per layer, the caller's own
# work between them) is not slept on right up to its next call: the waiter keeps its pace
# (dp.NEXT_EARLY_S), the gaps being those from an answer to the next doorbell; any gap under
# dp.NEXT_MAX_S in a process with spare CPUs (dp.spare_cpus), only a back-to-back caller's
# (under dp.NEXT_MAX_FEW_S) without.
WAIT_SLICE_S = 0.5  # FUTEX_WAIT slices: how soon a waiter notices its lease closed
PIN_MIN_ROWS = 256  # a GPU shard's host slot page-locks x and out rows from this many up


@dataclass(slots=True)
class _Pending:
    lease_id: str
    layout: dp.Layout
    slots: int
    transport: str
    created: float


class PinnedRows:
    """The x and out rows of one host slot (the memory at `base`, in `layout`; `out`:
    its output region as a flat bf16 tensor), page-locked for `device` on demand
    (cudamem.PinnedHost), so a GPU shard's runner copies a call's rows to and from
    the GPU by DMA straight from the slot instead of through its staging buffer. The
    locked prefix of each region grows by doubling from PIN_MIN_ROWS: only rows some
    call used become resident, and each size is registered once. Used by the one
    thread running the slot's call; `release` only when no copy of the slot's rows
    is queued."""

    def __init__(self, base: int, layout: dp.Layout, device, out: torch.Tensor) -> None:
        self.base, self.layout, self.device, self.out = base, layout, device, out
        self.rows = 0
        self.refused = False  # the driver would not lock the rows: not asked again
        self._ranges: list[cudamem.PinnedHost] = []

    def out_rows(self, m: int) -> torch.Tensor | None:
        """The output region's first m rows (bf16 [m, H]) for the runner to copy into,
        once x's and out's first m rows are locked; None when the rows must come
        through the slot's `write_output` (the driver refused)."""
        if self.refused or not self.cover(m):
            return None
        h = self.layout.hidden
        return self.out[: m * h].view(m, h)

    def cover(self, m: int) -> bool:
        """Lock at least the first m rows of x and out -> False when the driver refused
        (logged; nothing stays locked, and the caller stops asking)."""
        if m <= self.rows:
            return True
        lay = self.layout
        rows = PIN_MIN_ROWS
        while rows < m:
            rows *= 2
        rows = min(rows, lay.max_tokens)
        self.release()
        span = dp.round_pages(2 * rows * lay.hidden)  # whole pages, inside each region
        try:
            for offset in (lay.x_offset, lay.out_offset):
                self._ranges.append(cudamem.PinnedHost(self.base + offset, span, self.device))
        except cudamem.CudaIpcError as e:
            log.warning("slot memory not page-locked, its copies go through staging: %s", e)
            self.release()
            self.refused = True
            return False
        self.rows = rows
        return True

    def release(self) -> None:
        ranges, self._ranges, self.rows = self._ranges, [], 0
        for r in ranges:
            try:
                r.release()
            except cudamem.CudaIpcError as e:
                log.warning("slot memory not unregistered: %s", e)


def pin_device(servicer, pin: bool):
    """The GPU whose copies a host slot's rows are page-locked for (None: a CPU shard,
    a process without the CUDA runtime, or --pin-slots off)."""
    bank = servicer.bank
    if not pin or bank is None or bank.backend.device.type != "cuda":
        return None
    return bank.backend.device if cudamem.available()[0] else None


class Slot:
    """One slot's memory, as this process maps it, and its waiter. A cuda-ipc slot
    (layout.device) also owns a device buffer on `device` holding x and out."""

    def __init__(
        self, lease: Lease, index: int, fd: int, layout: dp.Layout, device=None, pin=None
    ) -> None:
        self.lease = lease
        self.index = index
        self.layout = layout
        self.mm: mmap.mmap | None = mmap.mmap(fd, layout.byte_size)
        self.ctl: dp.Control | None = dp.Control.from_buffer(self.mm)
        base = ctypes.addressof(self.ctl)
        self.req_addr = base + dp.Control.req_seq.offset
        self.resp_addr = base + dp.Control.resp_seq.offset
        # cuda-ipc: the slot's semaphore (dp.SEM_OFFSET), what a client whose doorbell a
        # CUDA stream rings wakes the waiter with; `sem` is its address once the lease's
        # client said it wakes that way (dp.WAKE_SEM), else 0 (FUTEX_WAKE on req_seq).
        self.sem = 0
        self._mapped: cudamem.PinnedHost | bool | None = None  # stream_bell's mapping
        if layout.device:
            dp.sem_init(base + dp.SEM_OFFSET)
            self.ctl.features = dp.FEATURE_SEM | dp.FEATURE_GRAPH
        self.lock = threading.Lock()
        self.busy = False  # a call is in flight (from the doorbell to its answer)
        self.seq = 0  # the call being answered
        self.bell_queued = False  # the runner's stream stores done_seq for it (stream_bell)
        self.answered = threading.Event()
        self.answered.set()
        self.thread: threading.Thread | None = None
        # Views of the regions, made once here: a call only slices them. ids and weights
        # are copied into this slot's own buffers (the call's tensors view those), so the
        # client cannot change an id once it was checked; x stays a view of the slot.
        mmax, k, h = layout.max_tokens, layout.top_k, layout.hidden
        buf = np.frombuffer(self.mm, np.uint8)
        self.dev: cudamem.DeviceBuffer | None = None
        self._out_dev: torch.Tensor | None = None
        if layout.device:
            self.dev = cudamem.DeviceBuffer(layout.device_bytes, device)
            mem = self.dev.tensor
            self._x = mem[: 2 * mmax * h].view(torch.bfloat16)
            off = layout.device_out_offset
            self._out_dev = mem[off : off + 2 * mmax * h].view(torch.bfloat16)
        else:
            self._x = torch.from_numpy(
                buf[layout.x_offset : layout.x_offset + 2 * mmax * h].view(np.int16)
            ).view(torch.bfloat16)
        self._ids_in = buf[layout.ids_offset : layout.ids_offset + 4 * mmax * k].view(np.int32)
        self._w_in = buf[layout.weights_offset : layout.weights_offset + 4 * mmax * k].view(
            np.float32
        )
        # cuda-ipc: where a call's ids and weights lie in the slot (host) and its x and out
        # rows (device), for a reader in C (server/lane.py; mapped while a call is in flight)
        self.lane_addresses = (0, 0, 0, 0)
        if self._out_dev is not None:
            base = buf.ctypes.data
            self.lane_addresses = (
                base + layout.ids_offset,
                base + layout.weights_offset,
                self._x.data_ptr(),
                self._out_dev.data_ptr(),
            )
        self._out = buf[layout.out_offset : layout.out_offset + 2 * mmax * h]
        # A GPU shard's host slot: the rows its calls use are page-locked on demand.
        self._pins: PinnedRows | None = None
        if pin is not None and not layout.device:
            out = torch.from_numpy(self._out.view(np.int16)).view(torch.bfloat16)
            self._pins = PinnedRows(ctypes.addressof(self.ctl), layout, pin, out)
        self._ids = torch.empty(mmax * k, dtype=torch.int32)
        self._w = torch.empty(mmax * k, dtype=torch.float32)
        self._ids_np, self._w_np = self._ids.numpy(), self._w.numpy()

    # -- views of the regions (valid while the slot is mapped) ------------------------

    def inputs(self, m: int, k: int, hidden: int):
        """The call's x (a view of the slot) and copies of its ids and weights."""
        if m == 0:
            return (
                torch.empty((0, hidden), dtype=torch.bfloat16, device=self._x.device),
                torch.empty((0, max(k, 1)), dtype=torch.int32),
                torch.empty((0, max(k, 1)), dtype=torch.float32),
            )
        n = m * k
        np.copyto(self._ids_np[:n], self._ids_in[:n])
        np.copyto(self._w_np[:n], self._w_in[:n])
        x = self._x[: m * hidden].view(m, hidden)
        return x, self._ids[:n].view(m, k), self._w[:n].view(m, k)

    @property
    def direct(self) -> bool:
        """Whether the runner can copy this slot's rows straight between the slot and
        the GPU (cuda-ipc device regions, or a GPU shard's pinnable host slot)."""
        return self._out_dev is not None or (self._pins is not None and not self._pins.refused)

    def device_out(self, m: int) -> torch.Tensor | None:
        """Where the runner copies the call's m output rows itself (bf16 [m, H]): the
        cuda-ipc slot's device region, or a GPU shard's host slot once its first m
        rows of x and out are page-locked; None when the rows come through
        `write_output` (a host slot that cannot be pinned: it is then never tried
        again). Called by the one thread running this slot's call."""
        h = self.layout.hidden
        if self._out_dev is not None:
            return self._out_dev[: m * h].view(m, h)
        if self._pins is None or self.mm is None:
            return None
        return self._pins.out_rows(m)

    def stream_bell(self) -> tuple[int, int] | None:
        """A cuda-ipc call queued on its client's stream (FLAG_STREAM): (the GPU address
        of done_seq, the call's seq), for the runner's stream to store once the rows are
        in the out region; None for any other call, or where the host slot cannot be
        mapped for the GPU (the host's store then releases the client's stream)."""
        ctl = self.ctl
        if self.dev is None or ctl is None or not ctl.flags & dp.FLAG_STREAM:
            return None
        if self._mapped is None:
            try:
                self._mapped = cudamem.PinnedHost(
                    ctypes.addressof(ctl), self.layout.byte_size, self.dev.device, mapped=True
                )
            except cudamem.CudaIpcError as e:
                log.warning("slot not mapped for the GPU's answers: %s", e)
                self._mapped = False
        if not self._mapped:
            return None
        self.bell_queued = True
        return self._mapped.device_ptr + dp.Control.done_seq.offset, self.seq

    def device_proof(self) -> int:
        """cuda-ipc: the u64 at the start of the output region (the client's nonce)."""
        return int(self._out_dev[:4].view(torch.int64).item())

    # -- answering ---------------------------------------------------------------------

    def write_output(self, rows, timing: dict, placed: bool = False) -> None:
        """The partial (uint8 [m, 2H] bf16 bits; `placed`: the runner copied it into
        `device_out` already), then OK, then ring (any thread)."""
        self._answer_ok(rows.shape[0], timing, None if placed else rows)

    def write_placed(self, m: int, timing: dict) -> None:
        """`write_output` of m rows the runner's stream put into the out region already."""
        self._answer_ok(m, timing, None)

    def _answer_ok(self, n: int, timing: dict, rows) -> None:
        with self.lock:
            if self.mm is None or not self.busy:
                return
            if n and rows is not None:
                self._out[: rows.size] = rows.reshape(-1)
            ctl = self.ctl
            for name, value in timing.items():
                setattr(ctl, name, value)
            ctl.out_rows = n
            ctl.status = 0
            if not ctl.flags & dp.FLAG_GRAPH:  # a graph's last error text: kept for its watch
                ctl.error_len = 0
            self._ring()

    def write_error(self, code: grpc.StatusCode, message: str) -> None:
        with self.lock:
            if self.mm is None or not self.busy:
                return
            data = message.encode("utf-8", "replace")[: dp.ERROR_BYTES]
            self.mm[dp.ERROR_OFFSET : dp.ERROR_OFFSET + len(data)] = data
            ctl = self.ctl
            ctl.error_len = len(data)
            ctl.out_rows = 0
            ctl.status = code.value[0]
            if ctl.flags & dp.FLAG_GRAPH:  # no host of the client waits for this call
                ctl.graph_status = code.value[0]
                ctl.graph_errors += 1
            self._ring()

    def _ring(self) -> None:
        """resp_seq = the call's seq, wake the client (and tell it on the socket when
        it asked to be told); the slot takes its next call. Under self.lock."""
        ctl = self.ctl
        notify = ctl.flags & dp.FLAG_NOTIFY
        ctl.answered_ns = time.monotonic_ns()
        # A graph's call whose rows the stream answered: its client's stream may be on
        # its next replay already, which set done_seq back to 0 (stored here, that would
        # release it before the shard has seen the call)
        if not (self.bell_queued and ctl.flags & dp.FLAG_GRAPH):
            ctl.done_seq = self.seq
        ctl.resp_seq = self.seq
        dp.futex_wake(self.resp_addr)
        self.busy = False
        if notify:
            self.lease.notify(self.index)
        if self.lease.closed:
            self._unmap()
        self.answered.set()

    def close(self) -> None:
        """Unmap now unless a call is in flight (then once it is answered)."""
        with self.lock:
            if self.sem and self.ctl is not None:
                dp.sem_post(self.sem)  # the waiter sees the lease's end now, not a slice later
            if not self.busy:
                self._unmap()
        self.answered.set()

    def _unmap(self) -> None:
        # The tensors of a call view the mmap object (torch keeps it alive): the mapping
        # goes with the last of them; ctl's export must go first.
        if self._pins is not None:  # before the mapping can go
            self._pins.release()
            self._pins = None
        if self._mapped:  # answered: no queued store reaches it any more
            with contextlib.suppress(cudamem.CudaIpcError):
                self._mapped.release()
        self._mapped = None
        self.ctl = None
        self._x = self._ids_in = self._w_in = self._out = self._out_dev = None
        self.mm = None
        if self.dev is not None:  # answered: no queued copy reads or writes it any more
            dev, self.dev = self.dev, None
            try:
                dev.free()
            except cudamem.CudaIpcError as e:
                log.warning("slot device memory not freed: %s", e)


class Lease:
    """One client connection's slots."""

    def __init__(self, registry: SlotRegistry, lease_id: str, conn: socket.socket, pid: int):
        self.registry = registry
        self.lease_id = lease_id
        self.conn = conn
        self.pid = pid
        self.slots: list[Slot] = []
        self.closed = False
        self.transport = dp.SHM
        self._send_lock = threading.Lock()

    def notify(self, index: int) -> None:
        """DONE on the socket, never blocking (a client that asked reads it)."""
        with contextlib.suppress(OSError), self._send_lock:
            self.conn.send(dp.DONE + dp.pack_u32(index), socket.MSG_DONTWAIT)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RDWR)
        for slot in self.slots:
            slot.close()
        self.registry._dropped(self)


class SlotRegistry:
    """Every lease of one server, its unix socket and its threads."""

    def __init__(self, servicer, instance_id: str, pin: bool = True) -> None:
        self.servicer = servicer
        self.pin = pin  # page-lock a GPU shard's host slots for its copies (PinnedHost)
        self.instance_id = instance_id
        self.name = f"expertd-{instance_id[:12]}-{secrets.token_hex(6)}"
        self._pending: dict[bytes, _Pending] = {}
        self.leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._closed = False
        # waiters keep their slots' pace (dp.NEXT_EARLY_S): any gap under NEXT_MAX_S with
        # spare CPUs, only a back-to-back caller's (dp.NEXT_MAX_FEW_S) without
        self.pace_max_s = dp.NEXT_MAX_S if dp.spare_cpus() else dp.NEXT_MAX_FEW_S
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.bind(dp.abstract_address(self.name))
        self._sock.listen(64)
        self._accepter = threading.Thread(
            target=self._accept_loop, name="expertd-slots", daemon=True
        )
        self._accepter.start()

    # -- registration (on the event loop) -----------------------------------------------

    def offered(self) -> list[str]:
        """The slot transports this server offers: shm, and cuda-ipc when its experts
        are on a GPU whose memory this process can export."""
        bank = self.servicer.bank
        if bank is not None and bank.backend.device.type == "cuda" and cudamem.available()[0]:
            return [dp.SHM, dp.CUDA_IPC]
        return [dp.SHM]

    def book(self, transport: str, slots: int, max_tokens: int, top_k: int, hidden: int):
        """A pending lease -> (token, lease id, layout). RequestError on a bad ask."""
        transport = transport or dp.SHM
        offered = self.offered()
        if transport not in offered:
            raise invalid(
                f"transport {transport!r} is not offered here (offered: {', '.join(offered)})"
            )
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
        token = secrets.token_bytes(24)
        lease_id = secrets.token_hex(8)
        layout = dp.Layout(max_tokens, top_k, hidden, transport == dp.CUDA_IPC)
        now = time.monotonic()
        with self._lock:
            for key in [k for k, p in self._pending.items() if now - p.created > PENDING_TTL_S]:
                del self._pending[key]
            self._pending[token] = _Pending(lease_id, layout, slots, transport, now)
        return token, lease_id, layout

    # -- the socket ----------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve_lease, args=(conn,), name="expertd-lease", daemon=True
            ).start()

    def _serve_lease(self, conn: socket.socket) -> None:
        """Handshake, then hold the lease until the connection ends."""
        lease = None
        try:
            lease = self._handshake(conn)
        except (OSError, ValueError) as e:
            log.info("slot registration refused: %s", e)
            with contextlib.suppress(OSError):
                conn.send(dp.REFUSED + str(e).encode()[:200])
        if lease is None:
            conn.close()
            return
        try:
            conn.settimeout(None)
            while True:
                msg = conn.recv(64)
                if not msg:  # the client closed it, or its process is gone
                    break
        except OSError:
            pass
        finally:
            lease.close()
            conn.close()

    def _handshake(self, conn: socket.socket) -> Lease | None:
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        hello = conn.recv(256)
        if not hello.startswith(dp.HELLO):
            raise ValueError("unexpected message on the lease socket")
        with self._lock:
            pending = self._pending.pop(hello[1:], None)
        if pending is None or time.monotonic() - pending.created > PENDING_TTL_S:
            raise ValueError("unknown or expired registration token")
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = struct.unpack("3i", creds)[0]
        lease = Lease(self, pending.lease_id, conn, pid)
        lease.transport = pending.transport
        try:
            self._share_slots(conn, lease, pending)
        except BaseException:  # a refused or broken registration keeps no mapping
            lease.close()
            raise
        return lease

    def _share_slots(self, conn: socket.socket, lease: Lease, pending) -> None:
        fds = []
        device = None
        if pending.layout.device:
            bank = self.servicer.bank
            if bank is None:
                raise ValueError("server is not serving")
            device = bank.backend.device
        pin = pin_device(self.servicer, self.pin)
        try:
            for i in range(pending.slots):
                fd = dp.sealed_memfd(
                    f"expertd-slot-{pending.lease_id}-{i}", pending.layout.byte_size
                )
                fds.append(fd)
                try:
                    lease.slots.append(Slot(lease, i, fd, pending.layout, device, pin))
                except cudamem.CudaIpcError as e:  # out of device memory, most likely
                    raise ValueError(f"no device memory for the slots: {e}") from None
            socket.send_fds(conn, [dp.FDS + pending.lease_id.encode()], fds)
        finally:
            for fd in fds:  # the mappings keep the memory; the client has its own fds
                os.close(fd)
        if device is not None:
            conn.send(dp.HANDLES + b"".join(slot.dev.handle() for slot in lease.slots))
        proof = conn.recv(16 + 8 * pending.slots)
        nonces = proof[1:]
        if not proof.startswith(dp.PROOF) or len(nonces) != 8 * pending.slots:
            raise ValueError("malformed mapping proof")
        for slot, (nonce,) in zip(lease.slots, struct.iter_unpack("<Q", nonces), strict=True):
            ctl = slot.ctl
            if ctl is None:
                raise ValueError("the lease ended during registration")
            if nonce == 0 or ctl.nonce != nonce:
                raise ValueError("mapping proof failed: the slot memory is not shared")
            if slot.dev is not None and slot.device_proof() != nonce & 0x7FFFFFFFFFFFFFFF:
                raise ValueError("mapping proof failed: the slot's device memory is not shared")
        with self._lock:
            if self._closed:
                raise ValueError("server is stopping")
            self.leases[lease.lease_id] = lease
        self.servicer.metrics.dataplane_leases.labels(lease.transport).inc()
        self.servicer.metrics.dataplane_slots.labels(lease.transport).inc(len(lease.slots))
        for slot in lease.slots:
            ctl = slot.ctl
            if ctl is None:
                raise ValueError("the lease ended during registration")
            ctl.nonce = 0
            if slot.dev is not None and ctl.wake == dp.WAKE_SEM:
                slot.sem = ctypes.addressof(ctl) + dp.SEM_OFFSET
            slot.thread = threading.Thread(
                target=self._wait_loop, args=(slot,), name="expertd-slot", daemon=True
            )
            slot.thread.start()
        conn.send(dp.READY)
        log.debug(
            "slot lease %s: %d slot(s) of %d tokens for pid %d",
            lease.lease_id,
            len(lease.slots),
            pending.layout.max_tokens,
            lease.pid,
        )

    def _dropped(self, lease: Lease) -> None:
        with self._lock:
            gone = self.leases.pop(lease.lease_id, None)
        if gone is not None:
            self.servicer.metrics.dataplane_leases.labels(lease.transport).dec()
            self.servicer.metrics.dataplane_slots.labels(lease.transport).dec(len(lease.slots))
            log.debug("slot lease %s ended (pid %d)", lease.lease_id, lease.pid)

    # -- the doorbell --------------------------------------------------------------------

    def _wait_loop(self, slot: Slot) -> None:
        last = 0
        lease = slot.lease
        gaps = dp.Recent()  # answer -> next doorbell
        answered = 0.0  # time.monotonic() when the last call was answered (0.0: none lately)
        took = False
        while not lease.closed:
            slot.answered.wait()  # one call at a time
            if lease.closed:
                break
            ctl = slot.ctl
            if ctl is None:
                break
            now = time.monotonic()
            if took:
                answered, took = now, False
            deadline = now + WAIT_SLICE_S
            spin = WAIT_SPIN_S
            low = gaps.low() if answered else 0.0
            if 0.0 < low < self.pace_max_s and ctl.req_seq == last:
                due = answered + low - dp.NEXT_EARLY_S
                if due > now:  # asleep until shortly before the next call is due
                    dp.wait_word(ctl, "req_seq", slot.req_addr, last, due, 0.0, slot.sem)
                spin = dp.NEXT_EARLY_S + dp.NEXT_SPIN_S
            if not dp.wait_word(ctl, "req_seq", slot.req_addr, last, deadline, spin, slot.sem):
                answered = 0.0  # a slice without a call: no pace to keep
                continue
            if answered:
                gaps.add(time.monotonic() - answered)
            took = True
            seq = last = ctl.req_seq
            ctl.seen_ns = time.monotonic_ns()
            if ctl.flags & dp.FLAG_GRAPH:  # every replay rings with GRAPH_SEQ: wait for 0 -> it
                ctl.req_seq = last = 0  # (after seen_ns: the client's settle reads them so)
            received = time.perf_counter_ns()
            with slot.lock:
                if slot.mm is None:
                    break
                slot.busy = True
                slot.seq = seq
                slot.bell_queued = False
                slot.answered.clear()
            self.servicer.take_slot_call(slot, lease.lease_id, self._take, slot, received)

    def _take(self, slot: Slot, received: int) -> None:
        """Read and check the rung call, then queue it (on the event loop)."""
        ctl = slot.ctl
        lay = slot.layout
        layer, m, k, timeout_us = ctl.layer, ctl.m, ctl.k, ctl.timeout_us
        bank = self.servicer.admit()
        if m > lay.max_tokens:
            raise invalid(f"m = {m} rows exceed the slot's {lay.max_tokens}")
        if m and not 1 <= k <= lay.top_k:
            raise invalid(f"top_k {k} outside the slot's [1, {lay.top_k}]")
        lane = self.servicer.lane
        if (
            lane is not None
            and slot.dev is not None
            and m
            and not tracing.active()
            and lane.run(slot, layer, m, k, timeout_us, received)
        ):
            return
        # ids and weights are copied (m * k words): the client cannot change an id after
        # it was checked. x stays a view; its values only shape the client's own answer.
        x, ids, w = slot.inputs(m, k, lay.hidden)
        trace = (ctl.trace_hi, ctl.trace_lo, ctl.span_id, ctl.trace_flags)
        self.servicer.run_slot_call(
            slot, bank, layer, x, ids, w, timeout_us, ctl.request_id, received, trace
        )

    def close(self) -> None:
        """Stop accepting and end every lease (clients see the socket close)."""
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
                lid: {"pid": lease.pid, "slots": len(lease.slots), "transport": lease.transport}
                for lid, lease in self.leases.items()
            }


def answer_later(fut: asyncio.Future, slot: Slot, servicer) -> None:
    """When `fut` (a Job's future) ends: errors into the slot (the finisher wrote a
    success already), and the servicer's books."""

    def done(f: asyncio.Future) -> None:
        servicer.release_inflight()
        if f.cancelled():
            servicer.count_slot(grpc.StatusCode.CANCELLED)
            slot.write_error(grpc.StatusCode.CANCELLED, "cancelled")
            return
        e = f.exception()
        if e is None:
            servicer.count_slot(grpc.StatusCode.OK)
        elif isinstance(e, RequestError):
            servicer.count_slot(e.code)
            slot.write_error(e.code, e.message)
        else:
            log.error("slot forward failed: %s", e)
            servicer.count_slot(grpc.StatusCode.INTERNAL)
            slot.write_error(grpc.StatusCode.INTERNAL, "internal error in forward")

    fut.add_done_callback(done)
