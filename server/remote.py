"""The shard's side of the cross-host data plane: slots registered over NIXL.

RegisterRemoteSlots (an authenticated, server-streaming RPC) carries the client's
NIXL agent metadata and one registered region per slot. The shard checks them
(the server instance the client registered with, the dtype, each region's size
against the slot layout), loads the client's agent, allocates and registers its own
slots (the same Layout as a same-host slot) and answers with its agent's metadata
and its slots' regions. The stream stays open: it is the lease. When it ends (the
client closed it, or its connection broke) the client's agent is unloaded and the
slots are deregistered.

A call arrives as the client's NIXL WRITE of the rows into a slot's input regions
with a CALL notification (delivered once the data is there). The progress thread
reads it, checks it exactly as a same-host slot call (server/slots.py: the region's
bounds, then validate.check_forward: layer, ids, admission) and runs it through
the batcher (run_direct when idle, else queued on the event loop). The batch's
finisher puts the slot's rows of the partial into the slot's output region and
WRITEs them into the client's slot with an ANSWER notification (sequence number,
status, timing); an error is an ANSWER alone, with its code and text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time

import grpc
import numpy as np
import torch

from expertd import dataplane as dp
from expertd import nixl
from expertd.cudamem import copy_into
from expertd.server.validate import RequestError, invalid
from expertd.v1 import expertd_pb2 as pb

log = logging.getLogger("expertd.server")

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _down_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that takes device slots' routes down to the host (one per GPU; the
    progress thread's)."""
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device)
    return stream


MAX_SLOTS_PER_LEASE = 16


class RemoteSlot:
    """One slot: this shard's registered memory and the client's region for it.

    Host slots (DRAM): x, ids and weights are read where the client wrote them.
    Device slots (VRAM, a GPU shard and a client whose regions are on its GPU): the
    slot is one buffer on this shard's GPU laid out as a host slot; the runner reads
    x there and writes the partial into its out region (as for a cuda-ipc slot), and
    ids and weights come down to the host for the checks."""

    def __init__(
        self, lease: RemoteLease, index: int, layout: dp.Layout, peer_region, device=None
    ) -> None:
        self.lease = lease
        self.index = index
        self.layout = layout
        self.device = device
        if device is None:
            self.buf = dp.host_buffer(layout.byte_size)  # pages appear once written
            self.addr = self.buf.ctypes.data
            self.device_id = 0
            self.memory = nixl.HOST
        else:
            # torch's memory: it goes back to the caching allocator only after
            # RemoteRegistry.release has deregistered it (the lease holds it until then)
            self.buf = torch.empty(layout.byte_size, dtype=torch.uint8, device=device)
            self.addr = self.buf.data_ptr()
            self.device_id = device.index or 0
            self.memory = nixl.DEVICE
            n = layout.max_tokens * layout.top_k
            self._ids = torch.empty(n, dtype=torch.int32).pin_memory()
            self._w = torch.empty(n, dtype=torch.float32).pin_memory()
        self.peer_addr = peer_region.address
        self.peer_device = peer_region.device_id
        self.handles = nixl.Handles(lease.registry.progress)
        self.lock = threading.Lock()
        self.busy = False
        self.seq = 0

    @property
    def direct(self) -> bool:
        """The runner copies a device slot's rows in and out itself (server/batcher.py)."""
        return self.device is not None

    def device_out(self, m: int) -> torch.Tensor | None:
        """Where the runner puts the call's m output rows (bf16 [m, H]): a device slot's
        out region; None for a host slot (the rows come through `write_output`)."""
        if self.device is None:
            return None
        off, h = self.layout.out_offset, self.layout.hidden
        return self.buf[off : off + 2 * m * h].view(torch.bfloat16).view(m, h)

    def stream_bell(self) -> None:
        """No call of this transport waits on a CUDA stream of its client."""
        return None

    def inputs(self, m: int, k: int, hidden: int, routes=None):
        """The call's x (a view of the slot: host or device), ids and weights (host
        tensors: the CALL's `routes` when it carried them; else views of a host slot,
        or on a device slot copies taken down from it)."""
        lay = self.layout
        if m == 0:
            return (
                torch.empty((0, hidden), dtype=torch.bfloat16, device=self.device or "cpu"),
                torch.empty((0, max(k, 1)), dtype=torch.int32),
                torch.empty((0, max(k, 1)), dtype=torch.float32),
            )
        raw = torch.from_numpy(self.buf) if self.device is None else self.buf
        x = raw[lay.x_offset : lay.x_offset + 2 * m * hidden].view(torch.bfloat16)
        if routes is not None:
            ids, w = routes
            return x.view(m, hidden), torch.from_numpy(ids), torch.from_numpy(w)
        ids = raw[lay.ids_offset : lay.ids_offset + 4 * m * k].view(torch.int32)
        w = raw[lay.weights_offset : lay.weights_offset + 4 * m * k].view(torch.float32)
        if self.device is not None:
            n = m * k
            with torch.cuda.device(self.device):  # the driver's copies need its context
                stream = _down_stream(self.device)
                copy_into(stream, self._ids[:n], ids)
                copy_into(stream, self._w[:n], w)
                stream.synchronize()
            ids, w = self._ids[:n], self._w[:n]
        return x.view(m, hidden), ids.view(m, k), w.view(m, k)

    def write_output(self, rows, timing: dict, placed: bool = False) -> None:
        """The partial (bf16 bits, [m, 2H] bytes) into the client's slot, then OK."""
        with self.lock:
            if not self.busy or self.lease.closed:
                return
            self.busy = False
            data = np.asarray(rows).reshape(-1).view(np.uint8)
            n = data.shape[0] // (2 * self.layout.hidden)
            message = nixl.pack_answer(self.index, self.seq, 0, n, timing)
            off = self.layout.out_offset
            lease = self.lease
            try:
                if n:
                    if not placed:  # a device slot's rows are there already (the runner)
                        self.buf[off : off + data.shape[0]] = data
                    self.handles.send(
                        n,
                        lambda: self._handle(lease.registry.agent, data.shape[0]),
                        lease.peer,
                        message,
                    )
                else:
                    lease.registry.progress.notify(lease.peer, message)
            except Exception as e:  # the client's agent is gone: its lease ends
                log.info("answer to %s not sent: %s", lease.peer, e)

    def _handle(self, agent, size: int):
        """A WRITE of `size` bytes of the output region into the client's (kept per
        row count by `handles`)."""
        off = self.layout.out_offset
        local = agent.get_xfer_descs([(self.addr + off, size, self.device_id)], self.memory)
        remote = agent.get_xfer_descs(
            [(self.peer_addr + off, size, self.peer_device)], self.lease.memory
        )
        return agent.initialize_xfer("WRITE", local, remote, self.lease.peer, b"")

    def write_error(self, code: grpc.StatusCode, message: str) -> None:
        with self.lock:
            if not self.busy or self.lease.closed:
                return
            self.busy = False
            lease = self.lease
            answer = nixl.pack_answer(self.index, self.seq, code.value[0], 0, {}, message)
            try:
                lease.registry.progress.notify(lease.peer, answer)
            except Exception as e:
                log.info("error answer to %s not sent: %s", lease.peer, e)


class RemoteLease:
    """One client agent's registration: its slots, held by the RPC's stream."""

    def __init__(self, registry: RemoteRegistry, lease_id: str, peer: str, memory: str) -> None:
        self.registry = registry
        self.lease_id = lease_id
        self.peer = peer  # the client's agent name
        self.memory = memory  # the client's regions' memory kind
        self.slots: list[RemoteSlot] = []
        self.reg = None  # this shard's registered descriptors
        self.closed = False
        self.transport = nixl.NIXL
        self.wake_token = b""  # its datagrams' token at the registry's WakePort


class RemoteRegistry:
    """Every NIXL lease of one server, its agent and its progress thread (made on the
    first registration: importing NIXL and starting UCX cost a moment)."""

    def __init__(self, servicer, instance_id: str) -> None:
        self.servicer = servicer
        self.instance_id = instance_id
        self.agent = None
        self.progress: nixl.Progress | None = None
        self.leases: dict[str, RemoteLease] = {}
        self._by_peer: dict[str, RemoteLease] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._closing: asyncio.Event | None = None
        # where callers wake the progress thread (nixl.WakePort): (host, port) to bind on
        # the first registration (the app sets the gRPC listen address's host and
        # --nixl-wake-port; host None: every interface, port 0: any), None: no port
        self.wake_at: tuple[str | None, int] | None = (None, 0)
        self.wake_port: nixl.WakePort | None = None

    def _start(self) -> None:
        if self.agent is None:
            self.agent = nixl.make_agent("shard")
            if self.wake_at is not None:
                try:
                    self.wake_port = nixl.WakePort(*self.wake_at)
                except OSError as e:  # calls still come: the thread finds them after a nap
                    log.warning("nixl: no wake port at %s (%s)", self.wake_at, e)
            self.progress = nixl.Progress(
                self.agent,
                self._on_notif,
                "expertd-nixl",
                keep_pace=dp.spare_cpus(),
                wake_port=self.wake_port,
            )

    # -- registration (off the event loop: NIXL calls block) ----------------------------

    def register(self, request, hidden: int):
        """Check and load a client's registration -> (lease, reply). RequestError."""
        limits = self.servicer.limits
        if request.transport != nixl.NIXL:
            raise invalid(f"transport {request.transport!r}: RegisterRemoteSlots serves nixl")
        if request.instance_id and request.instance_id != self.instance_id:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"registration for server instance {request.instance_id}, but this is "
                f"{self.instance_id} (the server restarted): describe it again",
            )
        if request.activation_dtype != pb.BF16:
            name = pb.DType.Name(request.activation_dtype)
            raise invalid(f"activation dtype {name}: slots carry BF16")
        slots = request.slots or 1
        if not 1 <= slots <= MAX_SLOTS_PER_LEASE:
            raise invalid(f"slots {slots} outside [1, {MAX_SLOTS_PER_LEASE}]")
        max_tokens = request.max_tokens or limits.max_tokens
        if max_tokens > limits.max_tokens:
            raise invalid(
                f"max_tokens {max_tokens}: this server accepts at most {limits.max_tokens}"
            )
        top_k = request.top_k or limits.max_top_k
        if not 1 <= top_k <= limits.max_top_k:
            raise invalid(f"top_k {top_k} outside [1, {limits.max_top_k}]")
        layout = dp.Layout(max_tokens, top_k, hidden)
        peer = request.nixl
        if len(peer.regions) != slots:
            raise invalid(f"{len(peer.regions)} registered regions for {slots} slots")
        kinds = {r.memory for r in peer.regions}
        device = None
        if kinds == {nixl.DEVICE}:
            device = self._device()
        elif kinds != {nixl.HOST}:
            raise invalid(
                f"region memory {sorted(kinds)}: all host (DRAM) or all device (VRAM) regions"
            )
        for i, region in enumerate(peer.regions):
            if region.byte_size < layout.byte_size:
                raise invalid(
                    f"slot {i}: a region of {region.byte_size} bytes, but the slot layout "
                    f"(max_tokens {max_tokens}, top_k {top_k}, hidden {hidden}) needs "
                    f"{layout.byte_size}"
                )
        if not peer.agent_name or not peer.agent_metadata:
            raise invalid("registration without the caller's NIXL agent")
        with self._lock:
            if self._closed:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "server is stopping")
            if peer.agent_name in self._by_peer:
                raise invalid(f"agent {peer.agent_name} is registered already")
        self._start()
        agent = self.agent
        try:
            name = agent.add_remote_agent(peer.agent_metadata)
        except Exception:
            raise invalid("the caller's NIXL agent metadata was not accepted") from None
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != peer.agent_name:
            with contextlib.suppress(Exception):
                agent.remove_remote_agent(name)
            raise invalid(f"agent metadata names {name}, not {peer.agent_name}")
        memory = nixl.HOST if device is None else nixl.DEVICE
        lease = RemoteLease(self, secrets.token_hex(8), name, memory)
        if self.wake_port is not None:
            lease.wake_token = self.wake_port.new_token()
        try:
            for i, region in enumerate(peer.regions):
                lease.slots.append(RemoteSlot(lease, i, layout, region, device))
            lease.reg = agent.register_memory(
                [(s.addr, layout.byte_size, s.device_id, "") for s in lease.slots], memory
            )
        except Exception as e:
            with contextlib.suppress(Exception):
                agent.remove_remote_agent(name)
            if self.wake_port is not None:
                self.wake_port.drop(lease.wake_token)
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"slot memory could not be registered ({e})"
            ) from None
        with self._lock:
            self.leases[lease.lease_id] = lease
            self._by_peer[name] = lease
        self.servicer.metrics.dataplane_leases.labels(nixl.NIXL).inc()
        self.servicer.metrics.dataplane_slots.labels(nixl.NIXL).inc(slots)
        log.info(
            "nixl lease %s: %d slot(s) of %d tokens for agent %s",
            lease.lease_id,
            slots,
            max_tokens,
            name,
        )
        reply = pb.RegisterSlotsResponse(
            lease_id=lease.lease_id,
            layout=layout.to_proto(pb),
            instance_id=self.instance_id,
            slots=slots,
            nixl=pb.NixlPeer(
                agent_name=agent.name,
                agent_metadata=agent.get_agent_metadata(),
                regions=[
                    pb.NixlRegion(
                        address=s.addr,
                        byte_size=layout.byte_size,
                        device_id=s.device_id,
                        memory=memory,
                    )
                    for s in lease.slots
                ],
            ),
            wake_port=self.wake_port.port if self.wake_port is not None else 0,
            wake_token=lease.wake_token,
        )
        return lease, reply

    def _device(self) -> torch.device:
        """The GPU that device (VRAM) slots live on: this shard's; RequestError on a
        CPU shard."""
        bank = self.servicer.bank
        device = bank.backend.device if bank is not None else None
        if device is None or device.type != "cuda":
            raise invalid(
                "device memory (VRAM) regions: this shard serves from the host "
                "(register host memory, DRAM)"
            )
        return device

    async def hold(self, lease: RemoteLease, drain: asyncio.Event) -> None:
        """Until the server drains or stops (the RPC's cancellation, when the client
        goes, ends it sooner). Draining ends the lease once its calls in flight are
        answered, so a server's stop does not wait out its grace for idle leases."""
        if self._closing is None:
            self._closing = asyncio.Event()
        if self._closed:
            return
        waits = [asyncio.ensure_future(self._closing.wait()), asyncio.ensure_future(drain.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        while not self._closed and any(slot.busy for slot in lease.slots):
            await asyncio.sleep(0.01)

    def release(self, lease: RemoteLease) -> None:
        """The lease's stream ended: unload the client's agent, free the slots."""
        with self._lock:
            if self.leases.pop(lease.lease_id, None) is None:
                return
            self._by_peer.pop(lease.peer, None)
        lease.closed = True
        if self.wake_port is not None:
            self.wake_port.drop(lease.wake_token)
        for slot in lease.slots:
            with slot.lock:
                slot.busy = False
        agent = self.agent
        for slot in lease.slots:
            slot.handles.close()
        with contextlib.suppress(Exception):
            agent.remove_remote_agent(lease.peer)
        if lease.memory == nixl.DEVICE:  # no batch may still copy into a device slot
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(lease.slots[0].device)
        with contextlib.suppress(Exception):
            agent.deregister_memory(lease.reg)
        self.servicer.metrics.dataplane_leases.labels(nixl.NIXL).dec()
        self.servicer.metrics.dataplane_slots.labels(nixl.NIXL).dec(len(lease.slots))
        log.info("nixl lease %s ended (agent %s)", lease.lease_id, lease.peer)

    # -- calls (on the progress thread) ---------------------------------------------------

    def _on_notif(self, peer: str, message: bytes) -> None:
        peer = peer.decode() if isinstance(peer, bytes) else peer
        with self._lock:
            lease = self._by_peer.get(peer)
        if lease is None or lease.closed:
            return
        try:
            index, seq, layer, m, k, timeout_us, rid, *trace = nixl.unpack_call(message)
            routes = nixl.call_routes(message, m, k)
        except ValueError:
            log.info("malformed notification from %s ignored", peer)
            return
        if index >= len(lease.slots):
            log.info("call for slot %d from %s ignored (it has %d)", index, peer, len(lease.slots))
            return
        slot = lease.slots[index]
        with slot.lock:
            if slot.busy:  # a client that rang a slot before its answer: refuse this call
                busy = True
            else:
                busy = False
                slot.busy, slot.seq = True, seq
        if busy:
            answer = nixl.pack_answer(
                index, seq, grpc.StatusCode.FAILED_PRECONDITION.value[0], 0, {}, "slot is busy"
            )
            with contextlib.suppress(Exception):
                self.progress.notify(peer, answer)
            return
        received = time.perf_counter_ns()
        call = (slot, layer, m, k, timeout_us, rid, received, trace, routes)
        self.servicer.take_slot_call(slot, lease.lease_id, self._take, *call)

    def _take(
        self, slot: RemoteSlot, layer, m, k, timeout_us, rid, received, trace, routes
    ) -> None:
        lay = slot.layout
        bank = self.servicer.admit()
        if m > lay.max_tokens:
            raise invalid(f"m = {m} rows exceed the slot's {lay.max_tokens}")
        if m and not 1 <= k <= lay.top_k:
            raise invalid(f"top_k {k} outside the slot's [1, {lay.top_k}]")
        x, ids, w = slot.inputs(m, k, lay.hidden, routes)
        if slot.device is None and routes is None:  # checked values stay checked (the
            ids, w = ids.clone(), w.clone()  # CALL's and a device slot's are copies)
        self.servicer.run_slot_call(slot, bank, layer, x, ids, w, timeout_us, rid, received, trace)

    def close(self) -> None:
        """End every lease (their streams end) and stop the progress thread."""
        with self._lock:
            self._closed = True
            leases = list(self.leases.values())
        if self._closing is not None:
            self._closing.set()
        for lease in leases:
            self.release(lease)
        if self.progress is not None:
            self.progress.stop()
        if self.wake_port is not None:
            self.wake_port.close()

    def stats(self) -> dict:
        with self._lock:
            return {
                lid: {"agent": lease.peer, "slots": len(lease.slots), "transport": nixl.NIXL}
                for lid, lease in self.leases.items()
            }
