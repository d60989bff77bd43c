"""The client's side of the cross-host data plane (`nixl`): slots registered with a
shard replica over NIXL, filled and sent from the caller's thread or the event loop.

The client holds one NIXL agent (made on first use) and its progress thread. A
lease with a replica (expertd/nixl.py, docs/dataplane.md "Across hosts: NIXL"):
the client allocates and registers its slots (the same Layout as a same-host
slot), sends its agent's metadata and the slots' regions in RegisterRemoteSlots
(with its credentials), and loads the shard's agent from the first answer. That
stream stays open for the lease's life: closing it frees the registration on the
shard, and its end from the shard's side (stopped, restarted, gone) fails the
calls in flight at once with UNAVAILABLE, so the caller fails over as on gRPC.

A call: the routed rows go straight into the slot's input regions (one gather),
then one NIXL WRITE of them into the shard's slot (through a handle the slot keeps
for that shape) with a CALL notification that carries the routes when they are
small (else the WRITE does). The shard WRITEs the partial into the slot's output
region with an ANSWER notification (sequence number, status, timing). A caller
waiting on its thread polls the agent itself for it (`Progress.drive`); otherwise
the progress thread hands it to the waiter: a threading.Event, or a future on an
event loop. The partial is read where it lies until the caller releases the slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time

import grpc
import numpy as np
import torch

from expertd import dataplane as dp
from expertd import nixl, rawtcp
from expertd.client.cudaipc import gather_rows, side_stream
from expertd.client.shm import NO_TRACE, LeaseError, SlotPool, fill_rows
from expertd.client.stream import StreamCallError
from expertd.cudamem import copy_into

log = logging.getLogger("expertd.client")

WAIT_SLICE_S = 0.02  # the caller's thread checks the lease's end this often
# a caller's thread drives the agent itself (polls it) while it waits, for at most this
# long, when the slot's last call was answered within it; longer calls are left to
# the progress thread (a long forward does not hold a core spinning)
DRIVE_S = 2e-3
DEFAULT_TOP_K = 64  # routes per row a slot holds when the replica does not say
SLOTS = 4  # slots per replica: calls beyond this many at once use gRPC
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_warned = threading.Event()


def usable() -> bool:
    """Is NIXL importable here? Without it the client says so once, then uses gRPC."""
    if nixl.load() is not None:
        return True
    if not _warned.is_set():
        _warned.set()
        log.warning("cross-host data plane off, calls go over gRPC: %s", nixl.why())
    return False


class ClientAgent:
    """This client's NIXL agent, its progress thread and its leases by shard agent."""

    def __init__(self) -> None:
        self.agent = nixl.make_agent("client")
        self.name = self.agent.name
        self.leases: dict[str, NixlLease] = {}
        self._lock = threading.Lock()
        self.progress = nixl.Progress(self.agent, self._on_notif, "expertd-nixl-client")
        # a connection to a shard's agent that outlived its lease's time (an address UCX
        # cannot reach: the connect waits for the kernel's timeout, minutes, holding the
        # agent): no new lease tries NIXL until it returns
        self.stuck = ""

    async def connect(self, metadata: bytes, timeout: float) -> str:
        """Load a shard's agent and connect to it -> its name; off the event loop (a
        peer that UCX cannot reach blocks the call for minutes), within `timeout`
        (LeaseError after it, and `stuck` says so until the call returns)."""
        if self.stuck:
            raise LeaseError(self.stuck)
        loop = asyncio.get_running_loop()
        done = loop.run_in_executor(None, self._connect, metadata)
        try:
            return await asyncio.wait_for(asyncio.shield(done), timeout)
        except TimeoutError:
            self.stuck = (
                f"NIXL could not reach a shard's agent in {timeout:.3g} s; no NIXL lease "
                "is tried until that connection attempt ends"
            )
            done.add_done_callback(self._unstuck)
            raise LeaseError(self.stuck) from None

    def _connect(self, metadata: bytes) -> str:
        try:
            peer = self.agent.add_remote_agent(metadata)
        except Exception:
            raise LeaseError("the shard's NIXL agent metadata was not accepted") from None
        peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        with contextlib.suppress(Exception):
            self.agent.make_connection(peer)
        return peer

    def _unstuck(self, done) -> None:
        """The late connection attempt ended: drop the agent it made, if it made one."""
        self.stuck = ""
        if not done.cancelled() and done.exception() is None:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(done.result())

    def _on_notif(self, peer, message: bytes) -> None:
        peer = peer.decode() if isinstance(peer, bytes) else peer
        with self._lock:
            lease = self.leases.get(peer)
        if lease is None:
            return
        try:
            index, seq, status, rows, timing, text = nixl.unpack_answer(message)
        except ValueError:
            log.info("malformed notification from %s ignored", peer)
            return
        if index < len(lease.slots):
            lease.slots[index].answer(seq, status, rows, timing, text)

    def add(self, lease: NixlLease) -> None:
        with self._lock:
            self.leases[lease.peer] = lease

    def drop(self, lease: NixlLease) -> None:
        """Forget a lease; its agent and memory are let go on a thread of their own (the
        agent's calls wait while a connection attempt holds it)."""
        with self._lock:
            if self.leases.get(lease.peer) is lease:
                del self.leases[lease.peer]
        # a device slot's memory is torch's: it goes back to the caching allocator only
        # once NIXL no longer has it registered (the thread holds the last references)
        mems = [slot.mem for slot in lease.slots if slot.mem is not None]
        handles = [slot.handles for slot in lease.slots]
        threading.Thread(
            target=self._release,
            args=(lease.peer, lease.reg, mems, handles),
            name="expertd-nixl-drop",
            daemon=True,
        ).start()

    def _release(self, peer: str, reg, mems=(), handles=()) -> None:
        for kept in handles:
            kept.close()
        if peer:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(peer)
        if reg is not None:
            with contextlib.suppress(Exception):
                self.agent.deregister_memory(reg)
        if mems:  # an answer's sum may still read a slot on a stream of the caller's
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(mems[0].device)

    def close(self) -> None:
        # with a connection attempt holding the agent the thread cannot end yet: no wait
        self.progress.stop(wait=not self.stuck)


class NixlSlot:
    """One slot: this client's registered memory and the shard's region for it.

    Host slots (`buf`, DRAM): the rows are gathered and the answer read on the host.
    Device slots (`mem`, VRAM, a caller on a GPU and a GPU shard): the slot is one
    buffer on this client's GPU laid out as a host slot; the rows are gathered into it
    on the GPU and the answer is a bf16 [rows, H] view of its out region there, summed
    on the caller's GPU (client/devsum.py) as a cuda-ipc answer is. UCX moves the
    bytes between the two GPUs' memories (CUDA IPC on one host, GPUDirect RDMA across
    hosts where the NIC offers it)."""

    def __init__(self, lease: NixlLease, index: int, layout: dp.Layout, buf=None, mem=None):
        self.lease = lease
        self.index = index
        self.layout = layout
        self.buf = buf
        self.mem = mem
        self.on_device = mem is not None  # start() takes the caller's tensor
        h, k, mmax = layout.hidden, layout.top_k, layout.max_tokens
        x_span = slice(layout.x_offset, layout.x_offset + 2 * mmax * h)
        ids_span = slice(layout.ids_offset, layout.ids_offset + 4 * mmax * k)
        w_span = slice(layout.weights_offset, layout.weights_offset + 4 * mmax * k)
        out_span = slice(layout.out_offset, layout.out_offset + 2 * mmax * h)
        if mem is None:
            self.addr = buf.ctypes.data
            self.device_id = 0
            self.memory = nixl.HOST
            self.x = buf[x_span].view(np.uint16)
            self.ids = buf[ids_span].view(np.int32)
            self.w = buf[w_span].view(np.float32)
            self.out = buf[out_span].view(np.uint16)
        else:
            t = mem  # uint8 [byte_size] on this client's GPU
            self.addr = t.data_ptr()
            self.device_id = t.device.index or 0
            self.memory = nixl.DEVICE
            self.x_dev = t[x_span].view(torch.bfloat16).view(mmax, h)
            self.ids_dev = t[ids_span].view(torch.int32)
            self.w_dev = t[w_span].view(torch.float32)
            self.out_dev = t[out_span].view(torch.bfloat16).view(mmax, h)
            # the routes go up from page-locked memory: their copies queue on the stream
            self.ids_pin = torch.empty(mmax * k, dtype=torch.int32).pin_memory()
            self.w_pin = torch.empty(mmax * k, dtype=torch.float32).pin_memory()
            self.stream = side_stream(t.device)
            # the caller's stream may still be summing the last answer out of the out
            # region (devsum.DeviceSum.finish with `done`): the next call waits for it
            self.read_done = torch.cuda.Event()
            self.reading = False
        self.remote_addr = 0
        self.remote_device = 0
        self.handles = nixl.Handles(lease.owner.progress)
        self.seq = 0
        self.rows = 0
        self.channel: NixlChannel | None = None
        self.held = False
        self.pending = False  # a call was sent and not answered yet
        self.sent_at = 0.0
        self.took = 0.0  # how long the last call took from its start to its answer (s)
        self.event = threading.Event()
        self._answer = None  # (status, rows, timing, text) of the call `seq`

    def release(self) -> None:
        self.held = False
        if not self.lease.closed and self.channel is not None:
            self.channel.release(self)

    def idle(self) -> bool:
        """Answered everything sent (a call abandoned at its deadline keeps the slot
        out of use until the shard answers it)."""
        return not self.pending

    def start(
        self, layer, x_bits: np.ndarray, tokens, ids, w, timeout: float, notify, trace=NO_TRACE
    ):
        """Write one call's rows and send them with the call (see shm.Slot.start).
        x_bits: uint16 [M, H] host bits, or for a device slot the caller's bf16 tensor."""
        k = ids.shape[1]
        inline = nixl.routes_inline(ids.shape[0], k)
        m = self._gather(x_bits, tokens, ids, w, inline) if self.on_device else None
        if m is None:
            m = fill_rows(self, x_bits, tokens, ids, w)
        routes = nixl.inline_routes(ids, w) if inline else b""
        self.rows = m
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        self._answer = None
        self.event.clear()
        self.pending = True
        self.sent_at = time.monotonic()
        lease = self.lease
        timeout_us = max(int(timeout * 1e6), 1)
        message = nixl.pack_call(self.index, self.seq, layer, m, k, timeout_us, 0, trace, routes)
        agent = lease.owner.agent
        progress = lease.owner.progress
        if notify:  # no thread of the caller's waits (drives the agent): the thread polls
            progress.expect(self, time.monotonic() + timeout)
        try:
            if m:
                seq = self.seq
                self.handles.send(
                    (m, k),
                    lambda: self._handle(agent, lease.peer, m, k),
                    lease.peer,
                    message,
                    lambda s: self._sent(seq, s),
                    wake=notify,
                )
            else:
                progress.notify(lease.peer, message, wake=notify)
        except Exception as e:
            self.pending = False
            lease.ended(f"NIXL transfer failed ({e})")
            raise lease.error() from None
        lease.ring()

    def _handle(self, agent, peer: str, m: int, k: int):
        """A WRITE of m rows' x, and of their ids and weights unless the CALL carries
        them, into the same offsets of the shard's slot (kept per (m, k) by `handles`)."""
        lay, h = self.layout, self.layout.hidden
        spans = [(lay.x_offset, 2 * m * h)]
        if not nixl.routes_inline(m, k):
            spans += [(lay.ids_offset, 4 * m * k), (lay.weights_offset, 4 * m * k)]
        local = agent.get_xfer_descs(
            [(self.addr + o, n, self.device_id) for o, n in spans], self.memory
        )
        remote = agent.get_xfer_descs(
            [(self.remote_addr + o, n, self.remote_device) for o, n in spans], self.memory
        )
        return agent.initialize_xfer("WRITE", local, remote, peer, b"")

    def _gather(self, x, tokens, ids, w, inline: bool) -> int:
        """A device slot's rows, and its routes unless the CALL carries them, into its
        GPU buffer; returns once they are there (NIXL reads the memory as it is, after
        no stream) -> m."""
        m, k = ids.shape
        self.layout.check(m, k)
        gather_rows(self, x, tokens, m)
        if m and not inline:
            n = m * k
            self.ids_pin[:n].numpy()[:] = ids.reshape(-1)
            self.w_pin[:n].numpy()[:] = w.reshape(-1)
            copy_into(self.stream, self.ids_dev[:n], self.ids_pin[:n])
            copy_into(self.stream, self.w_dev[:n], self.w_pin[:n])
        if m:
            self.stream.synchronize()
        return m

    def _sent(self, seq: int, state: str) -> None:
        """The WRITE's end (progress thread): an error fails the lease's calls."""
        if state != "DONE" and seq == self.seq:
            self.lease.ended("NIXL transfer to the shard failed (its host or agent is gone)")

    def answer(self, seq: int, status: int, rows: int, timing: dict, text: str) -> None:
        """The shard's answer (progress thread)."""
        if seq != self.seq or not self.pending:
            return
        self._answer = (status, rows, timing, text)
        self.lease.active_at = now = time.monotonic()
        self.took = now - self.sent_at
        self.pending = False
        self.lease.owner.progress.settle(self)
        self.event.set()
        entry = self.lease.waiters.get(self.index)
        if entry is not None and entry[0] == seq:
            fut = entry[1]
            with contextlib.suppress(RuntimeError):  # its loop closed
                fut.get_loop().call_soon_threadsafe(_resolve, fut)

    def answered(self) -> bool:
        return self._answer is not None

    def _over(self) -> bool:
        return self._answer is not None or self.lease.closed

    def wait(self, deadline: float) -> bool:
        """Block until answered (True), the deadline (False) or the lease's end
        (StreamCallError UNAVAILABLE)."""
        progress = self.lease.owner.progress
        now = time.monotonic()
        if self.took > DRIVE_S or not progress.drive(self._over, min(deadline, now + DRIVE_S)):
            progress.expect(self, deadline)  # the progress thread polls from here
        while True:
            left = deadline - time.monotonic()
            if self.event.wait(max(min(left, WAIT_SLICE_S), 0)) and self.answered():
                return True
            if self.lease.closed:
                raise self.lease.error()
            if time.monotonic() >= deadline:
                return False

    def result(self) -> np.ndarray:
        status, rows, _timing, text = self._answer
        if status:
            raise StreamCallError(_CODES.get(status, grpc.StatusCode.UNKNOWN), text)
        if rows != self.rows:
            raise StreamCallError(
                grpc.StatusCode.INTERNAL, f"shard answered {rows} rows, expected {self.rows}"
            )
        if self.on_device:
            return self.out_dev[:rows]
        h = self.layout.hidden
        return self.out[: rows * h].reshape(rows, h)

    def timing(self) -> dict:
        return dict(self._answer[2]) if self._answer is not None else {}


async def _wake_socket(address: str, port: int, token: bytes):
    """(socket, address, token) for the shard's wake port on the host of its gRPC
    `address`, or None when that host does not resolve (calls then wait out the
    shard's naps)."""
    host = rawtcp.host_of(address)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError as e:
        log.info("nixl: the wake port of %s is not reachable (%s)", address, e)
        return None
    family, _, _, _, where = infos[0]
    sock = socket.socket(family, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    return sock, where, bytes(token)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _fail(fut: asyncio.Future, error: Exception) -> None:
    if not fut.done():
        fut.set_exception(error)
        fut.exception()


class NixlLease:
    """One registration with one replica: its stream, its slots, the shard's agent."""

    def __init__(self, owner: ClientAgent, instance_id: str) -> None:
        self.owner = owner
        self.instance_id = instance_id
        self.peer = ""
        self.lease_id = ""
        self.slots: list[NixlSlot] = []
        self.reg = None
        self.call = None  # the RegisterRemoteSlots stream
        self.watcher: asyncio.Task | None = None
        self.closed = False
        self.why = ""
        self.waiters: dict[int, tuple[int, asyncio.Future]] = {}
        # the shard's wake port (nixl.WakePort): (socket, address, token), or None
        self.wake: tuple[socket.socket, tuple, bytes] | None = None
        self.active_at = 0.0  # time.monotonic() of the last CALL sent or answer seen

    def ring(self) -> None:
        """After a CALL's WRITE: wake the shard's progress thread with a datagram, when
        the lease was quiet long enough that the thread may be in its naps (it polls
        often for Progress.HOT_S after any activity: its last answer, or a CALL)."""
        now = time.monotonic()
        quiet = now - self.active_at
        self.active_at = now
        if self.wake is None or quiet < nixl.Progress.HOT_S * 0.75:
            return
        sock, where, token = self.wake
        with contextlib.suppress(OSError):  # a hint: a lost one costs the shard's nap
            sock.sendto(token, where)

    def check_closed(self) -> bool:
        return self.closed

    def error(self) -> StreamCallError:
        return StreamCallError(grpc.StatusCode.UNAVAILABLE, f"nixl lease: {self.why}")

    def ended(self, why: str) -> None:
        """The lease is over (any thread): calls in flight fail with UNAVAILABLE."""
        if self.closed:
            return
        self.why = why
        self.closed = True
        for slot in self.slots:
            self.owner.progress.settle(slot)
            slot.event.set()
        for _seq, fut in list(self.waiters.values()):
            with contextlib.suppress(RuntimeError):
                fut.get_loop().call_soon_threadsafe(_fail, fut, self.error())

    async def watch(self) -> None:
        """Read the stream until it ends (on the event loop)."""
        why = "the shard ended the lease (stopped or restarted)"
        try:
            while True:
                msg = await self.call.read()
                if msg is grpc.aio.EOF:
                    break
        except asyncio.CancelledError:
            why = "closed by the client"
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED:
                why = "closed by the client"
            else:
                why = f"the lease's stream ended: {e.code().name}: {e.details()}"
        self.ended(why)

    def close(self) -> None:
        self.ended("closed by the client")
        if self.wake is not None:
            self.wake[0].close()
            self.wake = None
        if self.call is not None:
            self.call.cancel()
        if self.watcher is not None:
            self.watcher.cancel()
        self.owner.drop(self)


class NixlChannel(SlotPool):
    """Every slot this client holds with one replica over NIXL (see shm.ShmChannel)."""

    def usable(self) -> bool:
        if self.owner.stuck and not self.broken:  # its calls would wait for the agent
            self.broken = self.owner.stuck
        return super().usable()

    name = nixl.NIXL

    def __init__(self, owner: ClientAgent, address: str, info, device=None) -> None:
        """device: a torch.device of this client's GPU for device (VRAM) slots, or
        None for host ones."""
        self.owner = owner
        self.address = address
        self.device = device
        self.on_device = device is not None
        self.instance_id = info.instance_id
        self.info = info
        super().__init__()

    async def grow(self, stub, metadata, slots: int, timeout: float) -> None:
        """Register the replica's slots (LeaseError when it cannot). One registration
        per replica, of SLOTS slots: the shard knows this client's agent once."""
        from expertd.v1 import expertd_pb2 as pb

        if self.leases:
            raise LeaseError("every slot this replica gives is registered")
        slots = max(slots, SLOTS)

        info = self.info
        lay = dp.Layout(
            self.slot_tokens or info.max_tokens_per_request,
            info.top_k or DEFAULT_TOP_K,
            info.hidden_size,
        )
        owner = self.owner
        lease = NixlLease(owner, self.instance_id)
        memory = nixl.DEVICE if self.on_device else nixl.HOST
        try:
            for i in range(slots):
                if self.on_device:  # freed once deregistered (ClientAgent._release)
                    mem = torch.empty(lay.byte_size, dtype=torch.uint8, device=self.device)
                    lease.slots.append(NixlSlot(lease, i, lay, mem=mem))
                else:
                    lease.slots.append(NixlSlot(lease, i, lay, buf=dp.host_buffer(lay.byte_size)))
            lease.reg = owner.agent.register_memory(
                [(s.addr, lay.byte_size, s.device_id, "") for s in lease.slots], memory
            )
        except Exception as e:
            raise LeaseError(f"slot memory could not be registered with NIXL ({e})") from None
        request = pb.RegisterSlotsRequest(
            transport=nixl.NIXL,
            slots=slots,
            max_tokens=lay.max_tokens,
            top_k=lay.top_k,
            instance_id=self.instance_id,
            activation_dtype=pb.BF16,
            nixl=pb.NixlPeer(
                agent_name=owner.name,
                # read after registering: the shard finds these regions in it
                agent_metadata=owner.agent.get_agent_metadata(),
                regions=[
                    pb.NixlRegion(
                        address=s.addr,
                        byte_size=lay.byte_size,
                        device_id=s.device_id,
                        memory=memory,
                    )
                    for s in lease.slots
                ],
            ),
        )
        call = stub.RegisterRemoteSlots(request, metadata=metadata)
        lease.call = call
        try:
            try:
                reply = await asyncio.wait_for(call.read(), timeout)
            except TimeoutError:
                raise LeaseError("RegisterRemoteSlots: no answer in time") from None
            except grpc.RpcError as e:
                raise LeaseError(f"RegisterRemoteSlots: {e.code().name}: {e.details()}") from None
            if reply is grpc.aio.EOF:
                raise LeaseError("RegisterRemoteSlots: the shard closed the stream")
            if reply.instance_id != self.instance_id:
                raise LeaseError("the replica restarted while registering")
            try:
                theirs = dp.Layout.from_proto(reply.layout)
            except ValueError as e:
                raise LeaseError(str(e)) from None
            if theirs != lay or len(reply.nixl.regions) != slots:
                raise LeaseError("the shard answered another slot layout")
            for slot, region in zip(lease.slots, reply.nixl.regions, strict=True):
                if region.byte_size < lay.byte_size or region.memory != memory:
                    raise LeaseError("the shard's slot regions do not fit the layout")
                slot.remote_addr = region.address
                slot.remote_device = region.device_id
            lease.peer = await owner.connect(reply.nixl.agent_metadata, timeout)
            lease.lease_id = reply.lease_id
            if reply.wake_port and reply.wake_token:
                lease.wake = await _wake_socket(self.address, reply.wake_port, reply.wake_token)
            owner.add(lease)
        except BaseException:
            lease.closed = True
            call.cancel()
            owner.drop(lease)
            raise
        lease.watcher = asyncio.ensure_future(lease.watch())
        for slot in lease.slots:
            slot.channel = self
        with self._lock:
            self.leases.append(lease)
            self._free.extend(lease.slots)

    def close(self) -> None:
        with self._lock:
            leases, self.leases, self._free = self.leases, [], []
        for lease in leases:
            lease.close()
