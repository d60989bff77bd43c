"""AsyncExpertClient: discovery, replicas and failover, fan-out, the sum.

    async with await AsyncExpertClient.connect(addresses, token=...) as client:
        out = await client.forward(layer, hidden_states, topk_ids, topk_weights)

This is the engine; ExpertClient runs it on a background event loop. Every call
has one deadline: every attempt, backoff and probe fits inside it, so a call
ends with the result or an error naming experts and addresses, never a hang
and never a missing contribution. A replica that refuses a call for overload
gets it again after a pause (busy is not down); an answer or a Describe that
does not follow the protocol is an error naming the address at once.

grpc.aio can still owe the client's event loop events after close() (the
completions of calls it cancelled). In a process with other grpc.aio loops
(an ExpertClient's, an embedded server's), do not close that loop right
after: expertd.aioloop.run(main()) runs a coroutine as asyncio.run does and
leaves its loop open (expertd/aioloop.py says why).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import grpc
import torch

from expertd import dataplane as dp
from expertd import nixl as nixl_plane
from expertd import rawtcp, tracing
from expertd.client import cudaipc
from expertd.client import nixl as nixl_client
from expertd.client.channels import TLS, ExpertStub, call_metadata, metadata_tuples, open_channel
from expertd.client.core import (
    Inputs,
    Piece,
    bf16_bits,
    combine,
    forward_request,
    stage_inputs,
    to_caller,
)
from expertd.client.cudaipc import CudaIpcChannel, CudaIpcSlot
from expertd.client.devsum import HOST_SUM_MAX, DeviceSum
from expertd.client.errors import CoverageError, ShardCallError
from expertd.client.replicas import KEEPS_REPLICA, RETRYABLE, Endpoint, Pool
from expertd.client.routing import (
    RouteTable,
    ShardPart,
    Topology,
    describe_problem,
)
from expertd.client.shm import MAX_SLOTS, SLOTS_PER_LEASE, LeaseError, ShmChannel
from expertd.client.shm import Slot as ShmSlot
from expertd.client.stream import ForwardStream, StreamCallError
from expertd.client.tcp import TcpChannel, TcpSlot
from expertd.client.telemetry import Telemetry, transfer_attributes
from expertd.v1 import expertd_pb2 as pb

BUSY_PAUSE_MAX = 1.0  # s: the longest pause after an overload refusal

# transport= values: "auto" leases slots from each replica on this host (cuda-ipc slots
# from a GPU shard when this process works on a GPU, else shared memory), registers NIXL
# slots with the others when NIXL is installed, and uses gRPC for the rest; "cuda-ipc",
# "shm" and "nixl" ask for that data plane everywhere (a replica that cannot give it fails
# the call's attempt with UNAVAILABLE; without NIXL installed, "nixl" warns once and uses
# gRPC); "tcp" asks for slots over raw TCP connections everywhere (the tensors outside
# gRPC: what "auto" uses for a replica on another host when NIXL is not there, or that
# offers none); "grpc" (= "stream") and "unary" use no data plane.
TRANSPORTS = ("auto", "cuda-ipc", "shm", "nixl", "tcp", "grpc", "stream", "unary")
FORCED_SLOTS = ("cuda-ipc", "shm", "tcp")
GRAPH_SLOTS_PER_LEASE = 16  # a shard's largest lease (server/slots.py MAX_SLOTS_PER_LEASE)


class Fallback(Exception):
    """The caller's-thread path cannot finish this call: run it on the event loop."""


class AsyncExpertClient:
    def __init__(
        self,
        addresses: list[str],
        *,
        timeout: float = 30.0,
        discover_timeout: float = 5.0,
        metadata=None,
        token: str | None = None,
        tls: TLS | None = None,
        max_attempts: int = 3,
        retry_backoff: float = 0.01,
        refresh_s: float = 10.0,
        transport: str = "auto",
        attempt_share: float = 0.5,
        busy_retries: int = 6,
        busy_backoff: float = 0.05,
        metrics=None,
        slot_tokens: int = 0,
    ) -> None:
        """Opens channels only; `await client.refresh()` (or use `connect`) to discover.

        max_attempts: replicas tried per shard and call (each at most once);
        retry_backoff: first pause before a retry (doubles, jittered);
        refresh_s: how often a live address is re-described;
        transport: "auto" (the default: shared-memory slots with each replica on this
        host, NIXL with the others when installed, docs/dataplane.md; else gRPC),
        "cuda-ipc" (the shard's GPU memory mapped here forced), "shm" (shared memory
        forced), "nixl" (NIXL forced),
        "grpc" or "stream" (calls multiplexed over one ForwardStream per replica, see
        client/stream.py) or "unary" (one Forward RPC per shard and call);
        attempt_share: the part of the time left an attempt gets when another live
        replica could take over (a stalled replica then costs only that part);
        busy_retries: how many times a shard part is sent again after a replica
        refused it for overload (RESOURCE_EXHAUSTED), within the deadline;
        busy_backoff: the first pause after such a refusal (doubles, jittered, at
        most BUSY_PAUSE_MAX s). A busy replica stays in rotation: busy is not down.
        metrics: a prometheus_client CollectorRegistry to observe the calls' stage
        times in (client/telemetry.py; `timings()` has their totals either way);
        slot_tokens: the rows one data-plane slot holds (0, the default: as many as the
        replica takes in a request). Slots cost memory at both ends (at H = 4096 and
        16384 rows, 256 MiB each, GPU memory for cuda-ipc and NIXL device slots); a
        shard's part of a call with more rows goes over gRPC."""
        if not 0 < attempt_share <= 1:
            raise ValueError(f"attempt_share must be in (0, 1], not {attempt_share}")
        if slot_tokens < 0:
            raise ValueError(
                f"slot_tokens must be 0 (the replica's limit) or more, not {slot_tokens}"
            )
        self.slot_tokens = int(slot_tokens)
        self.attempt_share = attempt_share
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
        self.transport = transport
        self._rpc = "unary" if transport == "unary" else "stream"
        self._shm = transport in ("auto", "shm") and dp.available()
        self._cuda_ipc = transport in ("auto", "cuda-ipc") and dp.available()
        self._nixl = transport in ("auto", "nixl")  # NIXL itself is loaded on first use
        self._tcp = transport in ("auto", "tcp")
        self._slots_on = self._shm or self._cuda_ipc or self._nixl or self._tcp
        self._nixl_agent: nixl_client.ClientAgent | None = None
        self._nixl_why = ""
        self._leasing: dict[str, asyncio.Future] = {}  # address -> a lease being made
        if transport in ("cuda-ipc", "shm") and not dp.available():
            raise ValueError(f"transport {transport!r} needs Linux (memfd, futex, fd passing)")
        if not addresses:
            raise ValueError(f"{type(self).__name__} needs at least one address")
        self.addresses = list(dict.fromkeys(addresses))
        self.timeout = timeout
        self.discover_timeout = discover_timeout
        self.max_attempts = max_attempts
        self.retry_backoff = retry_backoff
        self.busy_retries = busy_retries
        self.busy_backoff = busy_backoff
        self._metadata = metadata_tuples(metadata)
        self._token = token
        self.telemetry = Telemetry(metrics)
        tracing.configure_from_env()  # EXPERTD_TRACE: spans of this process's calls
        # A stream's metadata is fixed when it opens: the client's own and its token.
        self._stream_md = tuple(
            kv for kv in call_metadata(self._metadata, token, "-", None) if kv[0] != "x-request-id"
        )
        endpoints = {}
        for a in self.addresses:
            channel = open_channel(a, tls)
            endpoints[a] = Endpoint(a, channel, ExpertStub(channel, self.telemetry))
        self._pool = Pool(endpoints, refresh_s=refresh_s)
        self._prober: asyncio.Task | None = None
        # RegisterSlots carries the client's own metadata and token.
        self._register_md = call_metadata(self._metadata, token, None, None)
        self._turn = 0
        self._partitions: dict = {}  # (id(topology), layer) -> (topology, shards or None)
        self._candidates: dict = {}  # (topology, layer, live shards) -> RouteTable
        self.topology: Topology | None = None

    @classmethod
    async def connect(cls, addresses: list[str], **kwargs) -> AsyncExpertClient:
        client = cls(addresses, **kwargs)
        try:
            await client.refresh()
            await client.open_dataplanes()
        except BaseException:
            await client.close()
            raise
        return client

    @property
    def unreachable(self) -> dict[str, str]:
        """address -> why, for every address out of rotation now."""
        return self._pool.down()

    def stats(self) -> dict[str, dict]:
        """Per address: alive, why not, calls in flight, calls answered, instance_id."""
        return self._pool.stats()

    def timings(self) -> dict[str, dict]:
        """Per stage of the calls so far (client/telemetry.py): count, total_s, mean_us."""
        return self.telemetry.summary()

    # -- the same-host data plane ---------------------------------------------------

    async def open_dataplanes(self, timeout: float | None = None) -> None:
        """Lease slots from every live replica on this host that has none yet (the
        transport is chosen per replica here, and again after it restarts)."""
        if not self._slots_on:
            return
        timeout = self.discover_timeout if timeout is None else timeout
        eps = [ep for ep in self._pool.endpoints.values() if ep.alive and ep.info is not None]
        await asyncio.gather(*(self._dataplane(ep, timeout) for ep in eps))

    async def _dataplane(self, ep: Endpoint, timeout: float) -> ShmChannel | None:
        """This replica's slots, leased on first use (and again after a restart);
        None when it is on gRPC (auto: not on this host, or it offers none)."""
        if not self._slots_on or ep.info is None:
            return None
        instance = ep.info.instance_id
        ch = ep.dataplane
        if ch is not None and (ch.instance_id != instance or not ch.usable()):
            ep.dataplane = None  # the replica restarted, or the lease ended: lease again
            ep.dataplane_for = "" if ch.instance_id == instance else ep.dataplane_for
            ep.dataplane_why = ch.broken or "replica restarted"
            ch.close()
            ch = None
            if ep.dataplane_for == instance:
                return None
        if ch is not None or ep.dataplane_for == instance:
            leasing = self._leasing.get(ep.address)
            if ch is None and leasing is not None:  # another call is leasing: its outcome
                await asyncio.shield(leasing)
                return ep.dataplane
            return ch
        ep.dataplane_for = instance
        leasing = self._leasing[ep.address] = asyncio.get_running_loop().create_future()
        try:
            return await self._choose_dataplane(ep, instance, timeout)
        finally:
            del self._leasing[ep.address]
            leasing.set_result(None)

    async def _choose_dataplane(self, ep: Endpoint, instance: str, timeout: float):
        """Lease slots of the first transport this replica offers and this client may
        use -> the channel, or None (ep.dataplane_why says why not)."""
        offered = ep.info.dataplanes
        whys = []
        if self._cuda_ipc:
            ok, why = cudaipc.usable()
            if dp.CUDA_IPC not in offered:
                whys.append("the replica offers no cuda-ipc data plane")
            elif not ok:
                whys.append(f"cuda-ipc: {why}")
            else:
                device = torch.device("cuda", torch.cuda.current_device())
                ch = CudaIpcChannel(ep.address, instance, device)
                if await self._lease(ep, ch, timeout, whys):
                    return ch
        if self._shm:
            if dp.SHM in offered:
                ch = ShmChannel(ep.address, instance)
                if await self._lease(ep, ch, timeout, whys):
                    return ch
            else:
                whys.append("the replica offers no same-host data plane")
        if self._nixl:
            if nixl_plane.NIXL not in offered:
                whys.append("the replica offers no NIXL data plane")
            elif (owner := self._nixl_owner()) is None:
                whys.append(self._nixl_why)
            elif owner.stuck:
                whys.append(owner.stuck)
            else:
                # GPU memory at both ends when this process works on a GPU and the shard
                # serves from one (UCX moves it GPU to GPU); host memory otherwise, or
                # when the shard would not register device slots
                devices = [None]
                if ep.info.device.startswith("cuda") and cudaipc.usable()[0]:
                    devices.insert(0, torch.device("cuda", torch.cuda.current_device()))
                for device in devices:
                    ch = nixl_client.NixlChannel(owner, ep.address, ep.info, device)
                    if await self._lease(ep, ch, timeout, whys):
                        return ch
        if self._tcp:
            if rawtcp.TCP not in offered:
                whys.append("the replica offers no tcp data plane")
            else:
                ch = TcpChannel(ep.address, instance)
                if await self._lease(ep, ch, timeout, whys):
                    return ch
        ep.dataplane_why = "; ".join(whys)
        return None

    async def _lease(self, ep: Endpoint, ch, timeout: float, whys: list[str]) -> bool:
        """Lease the first slots of channel `ch` with `ep`: True, and `ch` is its data
        plane; False (why appended to `whys`, `ch` closed) when it cannot be done."""
        limit = ep.info.max_tokens_per_request
        ch.slot_tokens = min(self.slot_tokens, limit) if limit else self.slot_tokens
        try:
            await ch.grow(ep.stub, self._register_md, SLOTS_PER_LEASE, timeout)
        except (LeaseError, OSError) as e:
            ch.close()
            whys.append(str(e))
            return False
        ep.dataplane, ep.dataplane_why = ch, ""
        return True

    def _nixl_owner(self) -> nixl_client.ClientAgent | None:
        """This client's NIXL agent, made on first use; None without NIXL (warned once)."""
        if self._nixl_agent is None and not self._nixl_why:
            if not nixl_client.usable():
                self._nixl_why = f"NIXL unavailable: {nixl_plane.why()}"
                return None
            try:
                self._nixl_agent = nixl_client.ClientAgent()
            except Exception as e:
                self._nixl_why = f"NIXL agent could not start: {e}"
        return self._nixl_agent

    async def _slot(self, ep: Endpoint, timeout: float, rows: int):
        """A free slot of this replica for `rows` rows, leasing more when all are busy;
        None: use gRPC."""
        ch = await self._dataplane(ep, timeout)
        if ch is None:
            forced = self.transport in FORCED_SLOTS
            if forced or (self.transport == "nixl" and not self._nixl_why):
                why = ep.dataplane_why or "no data plane slots"
                raise StreamCallError(
                    grpc.StatusCode.UNAVAILABLE, f"{self.transport} transport: {why}"
                )
            return None
        if not ch.fits(rows):  # larger than this client's slots (slot_tokens)
            return None
        slot = ch.acquire()
        if slot is None and ch.size < MAX_SLOTS:
            try:
                await ch.grow(ep.stub, self._register_md, SLOTS_PER_LEASE, timeout)
            except (LeaseError, OSError):
                return None
            slot = ch.acquire()
        return slot  # None: every slot busy; this call goes over gRPC

    async def _forward_slot(
        self, ep: Endpoint, slot, layer: int, inputs, part, timeout, md, traceparent=""
    ):
        """One attempt through a slot -> Piece (the slot stays held until the sum).
        traceparent: the attempt's span, carried in the slot's call header."""
        loop = asyncio.get_running_loop()
        lease = slot.lease
        if lease.closed:
            raise lease.error()
        m = inputs.m
        tokens = None if part.tokens.numel() == m else part.tokens.numpy()
        slot.start(
            layer,
            inputs.on_device if getattr(slot, "on_device", False) else bf16_bits(inputs.x),
            tokens,
            part.topk_ids.numpy(),
            part.topk_weights.numpy(),
            timeout,
            notify=True,
            trace=tracing.context_fields(traceparent),
        )
        if isinstance(slot, TcpSlot):  # its connection is read on this loop
            await slot.wait_async(timeout)
        elif not slot.answered():
            fut = loop.create_future()
            lease.waiters[slot.index] = (slot.seq, fut)
            try:
                if not slot.answered():  # answered before the waiter was in place
                    await asyncio.wait_for(fut, timeout)
            except TimeoutError:
                raise StreamCallError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed"
                ) from None
            finally:
                lease.waiters.pop(slot.index, None)
        bits = slot.result()
        ep.last_timing = slot.timing()
        return Piece(part.shard, part.tokens, bits, ep.address, ep.last_timing)

    # -- the caller's-thread path (ExpertClient.forward) -------------------------------

    def direct_ready(self) -> bool:
        """May calls try the caller's-thread path (slots with every shard)?"""
        return self._slots_on and self.topology is not None

    def execute_direct(self, layer: int, inputs: Inputs, deadline: float, md) -> torch.Tensor:
        """Route, write every shard's slot, ring all, wait for all, sum: on the calling
        thread, no hop through the event loop -> bf16 [M, H] on the host. Raises Fallback
        when a part has no free slot with a live replica, or an attempt failed in a way
        another replica might fix (the loop's path then runs the call with retries);
        ShardCallError for an error no retry fixes."""
        if tuple(kv for kv in md if kv[0] != "x-request-id") != self._stream_md:
            raise Fallback
        if tracing.active():
            raise Fallback  # spans are made on the loop's path
        topo = self.topology
        t0 = time.perf_counter_ns()
        parts, lost = self._plan(topo, layer, inputs.ids, inputs.weights)
        self.telemetry.add("route", time.perf_counter_ns() - t0)
        if lost:
            raise Fallback
        held = []
        try:
            for part in parts:
                ep, slot = self._direct_slot(topo, part)
                if slot is None:
                    raise Fallback
                held.append((part, ep, slot))
            x_bits = None
            m = inputs.m
            sent = time.perf_counter_ns()
            later = []
            for part, _ep, slot in held:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Fallback  # the loop's path words the deadline error
                tokens = None if part.tokens.numel() == m else part.tokens.numpy()
                ids, w = part.topk_ids.numpy(), part.topk_weights.numpy()
                if isinstance(slot, CudaIpcSlot):  # gathered on the GPU; rung below too
                    slot.start(layer, inputs.on_device, tokens, ids, w, remaining, False, False)
                    later.append(slot)
                    continue
                if getattr(slot, "on_device", False):  # a NIXL slot on this GPU
                    try:
                        slot.start(layer, inputs.on_device, tokens, ids, w, remaining, False)
                    except StreamCallError:
                        raise Fallback from None
                    continue
                if x_bits is None:
                    x_bits = bf16_bits(inputs.x)
                if isinstance(slot, ShmSlot):  # rung below, once every slot is written: a
                    slot.start(layer, x_bits, tokens, ids, w, remaining, False, ring=False)
                    later.append(slot)  # woken shard may take this CPU at once (2 cores)
                else:  # sent now (tcp, nixl): a lease that ended goes to the loop's path
                    try:
                        slot.start(layer, x_bits, tokens, ids, w, remaining, notify=False)
                    except StreamCallError:
                        raise Fallback from None
            waited = set()  # the GPU side streams gathering rows: each waited for once
            for slot in later:
                if isinstance(slot, CudaIpcSlot):
                    if id(slot.stream) not in waited:
                        slot.stream.synchronize()
                        waited.add(id(slot.stream))
                    slot.ring(gathered=True)
                else:
                    slot.ring()
            pieces = []
            for part, ep, slot in held:
                try:
                    if not slot.wait(deadline):
                        raise ShardCallError(
                            ep.address,
                            layer,
                            part.experts,
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            "deadline passed",
                        )
                    bits = slot.result()
                except StreamCallError as e:
                    if e.code() in RETRYABLE or e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise Fallback from None  # the loop's path retries, or pauses first
                    raise ShardCallError(
                        ep.address, layer, part.experts, e.code(), e.details()
                    ) from None
                ep.calls += 1
                ep.last_timing = slot.timing()
                self.telemetry.answered(time.perf_counter_ns() - sent, ep.last_timing)
                pieces.append(Piece(part.shard, part.tokens, bits, ep.address, ep.last_timing))
            t1 = time.perf_counter_ns()
            if any(isinstance(p.output, torch.Tensor) for p in pieces):  # cuda-ipc answers
                sums = DeviceSum(m, topo.hidden_size, inputs.device, m)
                for piece in pieces:
                    sums.stage(piece)
                slot = held[0][2] if len(held) == 1 else None
                done = getattr(slot, "read_done", None)
                out = sums.finish(pieces, done)
                if sums.queued:  # summed on the caller's stream: the slot's next ring waits
                    slot.reading = True
            else:
                out = combine(inputs, topo.hidden_size, pieces)
            t2 = time.perf_counter_ns()
            self.telemetry.add("sum", t2 - t1)
            self.telemetry.add("call", t2 - t0)
            return out
        finally:
            for _part, _ep, slot in held:
                slot.release()

    def stream_slots(self, layer: int, device: torch.device):
        """[(replica, shard, free cuda-ipc slot)], one per shard of `layer`, for a call
        queued on a CUDA caller's stream (client/onstream.py: every shard gets every
        token), or None: the layer's shards do not own each expert exactly once, one
        is not on cuda-ipc slots with a semaphore on `device`, or has none free."""
        topo = self.topology
        if topo is None or tracing.active():
            return None
        shards = self._partition(topo, layer)
        if shards is None:
            return None
        picked = []
        for shard in shards:
            got = self._stream_slot(shard, device)
            if got is None:
                for ep, _shard, slot in picked:
                    ep.dataplane.release(slot)
                return None
            picked.append((got[0], shard, got[1]))
        return picked

    async def keep_graph_slots(self, n: int, device: torch.device, timeout=None) -> list:
        """Lease `n` more cuda-ipc slots from every replica on `device` and keep them for
        calls captured in CUDA graphs (client/onstream.GraphCalls: one slot per shard per
        captured call, for good) -> the slots leased. Replicas on another data plane
        are left out (a captured call of their layers is refused)."""
        timeout = self.discover_timeout if timeout is None else timeout
        await self.open_dataplanes(timeout)

        async def keep(ep: Endpoint) -> list:
            ch = ep.dataplane
            if not isinstance(ch, CudaIpcChannel) or ch.device != device or not ch.usable():
                return []
            got: list = []
            while len(got) < n:
                take = min(n - len(got), GRAPH_SLOTS_PER_LEASE)
                got += await ch.grow(ep.stub, self._register_md, take, timeout, keep=True)
            ch.graph_free.extend(got)
            return got

        eps = [ep for ep in self._pool.endpoints.values() if ep.alive and ep.info is not None]
        return [slot for got in await asyncio.gather(*(keep(ep) for ep in eps)) for slot in got]

    def graph_slots(self, layer: int, device: torch.device):
        """[(replica, shard, kept slot)], one per shard of `layer`, for a call captured in
        a CUDA graph (`keep_graph_slots`), taken for good; None when the layer's shards do
        not own each expert exactly once or one has no kept slot left on `device`."""
        topo = self.topology
        shards = None if topo is None else self._partition(topo, layer)
        if shards is None:
            return None
        picked = []
        for shard in shards:
            for address in shard.addresses:
                ep = self._pool.endpoints[address]
                ch = ep.dataplane
                if (
                    ep.alive
                    and ep.info is not None
                    and isinstance(ch, CudaIpcChannel)
                    and ch.instance_id == ep.info.instance_id
                    and ch.device == device
                    and ch.usable()
                    and ch.graph_free
                    and ch.graph_free[-1].ctl.features & dp.FEATURE_GRAPH
                ):
                    picked.append((ep, shard, ch.graph_free.pop()))
                    break
            else:
                for ep, _shard, slot in picked:
                    ep.dataplane.graph_free.append(slot)
                return None
        return picked

    def _partition(self, topo: Topology, layer: int):
        """The shards serving `layer` when they own each of the E experts exactly once
        (so every shard can be sent every route), else None."""
        key = (id(topo), layer)
        if key not in self._partitions:
            shards = [s for s in topo.shards if layer in s.layers]
            owned = sorted(e for s in shards for e in s.experts)
            whole = owned == list(range(topo.num_experts))
            if len(self._partitions) > 4096:
                self._partitions.clear()
            self._partitions[key] = (topo, shards if whole else None)  # topo: id stays its
        return self._partitions[key][1]

    def _stream_slot(self, shard, device: torch.device):
        """(replica, free cuda-ipc slot with a semaphore on `device`) of one shard."""
        addresses = shard.addresses
        n = len(addresses)
        for i in range(n):
            ep = self._pool.endpoints[addresses[(self._turn + i) % n]]
            ch = ep.dataplane
            if (
                not ep.alive
                or ep.info is None
                or not isinstance(ch, CudaIpcChannel)
                or ch.instance_id != ep.info.instance_id
                or ch.device != device
                or not ch.usable()
            ):
                continue
            slot = ch.acquire()
            if slot is None:
                continue
            if not slot.sem:
                ch.release(slot)
                continue
            return ep, slot
        return None

    def _direct_slot(self, topo: Topology, part: ShardPart):
        """(replica, free slot) for a part on the caller's thread, or (None, None). A live
        replica whose slots are not leased yet (new, or restarted) sends the call to
        the loop's path, which leases them, so a restarted replica rejoins."""
        addresses = topo.shards[part.shard].addresses
        n = len(addresses)
        for i in range(n):
            ep = self._pool.endpoints[addresses[(self._turn + i) % n]]
            if not ep.alive or ep.info is None:
                continue
            ch = ep.dataplane
            if ch is None or ch.instance_id != ep.info.instance_id or not ch.usable():
                if ep.dataplane_for != ep.info.instance_id or ch is not None:
                    return None, None  # not decided for this instance yet
                continue  # on gRPC
            if not ch.fits(part.tokens.numel()):
                return None, None  # the loop's path sends it over gRPC
            slot = ch.acquire()
            if slot is not None:
                return ep, slot
        return None, None

    # -- discovery and probing ---------------------------------------------------------

    async def _describe(self, ep: Endpoint, timeout: float) -> bool:
        """Describe one address; True when what it serves changed."""
        md = call_metadata(self._metadata, self._token, None, None)
        try:
            info = await ep.stub.Describe(pb.DescribeRequest(), timeout=timeout, metadata=md)
        except grpc.RpcError as e:
            self._pool.mark_down(ep, f"{e.code().name}: {e.details()}")
            return False
        problem = describe_problem(info)
        if problem is not None:  # unusable until it describes itself sensibly
            changed = ep.info is not None
            ep.info = None
            self._pool.mark_down(ep, f"bad Describe: {problem}")
            return changed
        return self._pool.mark_up(ep, info)

    async def _probe(self, endpoints: list[Endpoint], timeout: float) -> None:
        changed = await asyncio.gather(*(self._describe(ep, timeout) for ep in endpoints))
        if any(changed):
            self._rebuild()

    def _rebuild(self) -> None:
        """A new topology from the last answers; an address that disagrees on the
        model's shape is taken out of rotation (with why), never mixed in."""
        known = {a: ep.info for a, ep in self._pool.endpoints.items() if ep.info is not None}
        alive = [a for a in known if self._pool.endpoints[a].alive]
        if not alive:
            return
        first = known[alive[0]]
        want = (first.hidden_size, first.intermediate_size, first.num_experts)
        for a, d in list(known.items()):
            got = (d.hidden_size, d.intermediate_size, d.num_experts)
            if got != want:
                del known[a]
                ep = self._pool.endpoints[a]
                self._pool.mark_down(ep, f"(H, I, E) = {got}, but {alive[0]} has {want}")
        self.topology = Topology.from_describe(known)
        self._candidates.clear()

    async def refresh(self, timeout: float | None = None) -> Topology:
        """Describe every address now and rebuild the map; starts background probing."""
        timeout = self.discover_timeout if timeout is None else timeout
        await self._probe(list(self._pool.endpoints.values()), timeout)
        self._rebuild()
        if self._prober is None:
            self._prober = asyncio.ensure_future(self._probe_loop())
        if self.topology is None or not any(ep.alive for ep in self._pool.endpoints.values()):
            raise CoverageError(-1, [], self.unreachable)
        return self.topology

    async def _probe_loop(self, tick: float = 0.1) -> None:
        """Re-describe addresses when due: dead ones with backoff, live ones every refresh_s."""
        while True:
            await asyncio.sleep(tick)
            due = self._pool.due(time.monotonic())
            if due:
                await self._probe(due, self.discover_timeout)

    # -- one call ----------------------------------------------------------------------

    def prepare(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        timeout: float | None = None,
        metadata=None,
        request_id: str | None = None,
        token: str | None = None,
    ):
        """Caller-side work (checks, host staging) -> (inputs, deadline, metadata).

        timeout: seconds for the whole call (default: the client's); metadata: a
        dict or pairs; request_id: sent as x-request-id (one is made up when
        None); token: overrides the client's bearer token for this call."""
        if self.topology is None:
            raise RuntimeError("client has not discovered the shards yet: await refresh()")
        t0 = time.perf_counter_ns()
        inputs = stage_inputs(self.topology, hidden_states, topk_ids, topk_weights)
        self.telemetry.add("stage", time.perf_counter_ns() - t0)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        md = call_metadata(self._metadata, token or self._token, request_id, metadata)
        return inputs, deadline, md

    async def forward(
        self,
        layer: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        **options,
    ) -> torch.Tensor:
        """-> bf16 [M, H] on hidden_states' device: the layer's expert output.

        options: timeout, metadata, request_id, token (see `prepare`)."""
        if self.topology is None:
            await self.refresh()
        inputs, deadline, md = self.prepare(hidden_states, topk_ids, topk_weights, **options)
        return to_caller(await self.execute(layer, inputs, deadline, md), inputs)

    async def execute(
        self, layer: int, inputs: Inputs, deadline: float, md, parent=None
    ) -> torch.Tensor:
        """Route, fan out, sum -> bf16 [M, H] on the host (on the caller's GPU for a CUDA
        caller: client/devsum.py). parent: the caller's
        OpenTelemetry Context when tracing (default: this task's current span)."""
        t0 = time.perf_counter_ns()
        if not tracing.active():
            out = await self._execute(layer, inputs, deadline, md)
            self.telemetry.add("call", time.perf_counter_ns() - t0)
            return out
        attrs = {"expertd.layer": layer, "expertd.tokens": inputs.m}
        span = tracing.start("expertd.client.call", attrs, parent)
        token = tracing.attach(span)
        error = None
        try:
            out = await self._execute(layer, inputs, deadline, md)
        except BaseException as e:
            error = e
            raise
        finally:
            tracing.detach(token)
            tracing.end(span, error)
        self.telemetry.add("call", time.perf_counter_ns() - t0)
        return out

    async def _execute(self, layer: int, inputs: Inputs, deadline: float, md) -> torch.Tensor:
        topo = self.topology
        t0 = time.perf_counter_ns()
        parts, lost = self._plan(topo, layer, inputs.ids, inputs.weights)
        self.telemetry.add("route", time.perf_counter_ns() - t0)
        if lost and await self._probe_owners(topo, layer, lost, deadline):
            topo = self.topology  # a shard came back: plan again
            parts, lost = self._plan(topo, layer, inputs.ids, inputs.weights)
        if lost:
            raise CoverageError(layer, lost, self._pool.down(self._owners(topo, layer, lost)))
        held: list = []  # slots whose output regions the pieces view, until summed
        # A CUDA caller's answers go to its GPU as they arrive and are summed there, unless
        # they are small: then the host sum and one copy cost less (devsum.HOST_SUM_MAX).
        sums = None
        if inputs.device.type == "cuda":
            rows = sum(p.tokens.numel() for p in parts)
            if rows * topo.hidden_size > HOST_SUM_MAX:
                sums = DeviceSum(inputs.m, topo.hidden_size, inputs.device, rows)

        async def send(part: ShardPart) -> list[Piece]:
            pieces = await self._send(topo, layer, inputs, part, deadline, md, held=held)
            if sums is not None:
                for piece in pieces:
                    sums.stage(piece)
            return pieces

        fanout = None
        if tracing.active():  # the shards' calls (their tasks) are its children
            fanout = tracing.start("expertd.client.fanout", {"expertd.shards": len(parts)})
            token = tracing.attach(fanout)
        try:
            try:
                pieces = [p for ps in await _all(send(p) for p in parts) for p in ps]
            finally:
                if fanout is not None:
                    tracing.detach(token)
                    fanout.end()
            t0 = time.perf_counter_ns()
            if sums is not None:
                out = sums.finish(pieces)
            else:
                out = combine(inputs, topo.hidden_size, pieces)
            t1 = time.perf_counter_ns()
            self.telemetry.add("sum", t1 - t0)
            if fanout is not None:
                tracing.record("expertd.client.sum", t0, t1)
            return out
        finally:
            if sums is not None:
                sums.close()
            for slot in held:
                slot.release()

    def _plan(self, topo, layer, ids, weights, avoid=frozenset()):
        """Split the routes over the shards with a live replica -> (parts, lost experts)."""
        live = {
            s
            for s, shard in enumerate(topo.shards)
            if s not in avoid and any(self._pool.endpoints[a].alive for a in shard.addresses)
        }
        self._turn += 1
        key = (id(topo), layer, frozenset(live))
        table = self._candidates.get(key)
        if table is None:  # one table per topology, layer and set of live shards
            if len(self._candidates) > 256:
                self._candidates.clear()
            table = self._candidates[key] = RouteTable(topo.candidates(layer, live))
        return table.route(ids, weights, self._turn)

    async def _probe_owners(self, topo, layer, lost, deadline) -> bool:
        """Before failing a call: look again at the dead addresses that might own
        `lost` (only those whose backoff has passed, within the deadline)."""
        now = time.monotonic()
        names = self._owners(topo, layer, lost)
        due = [
            ep for a in names if not (ep := self._pool.endpoints[a]).alive and ep.next_probe <= now
        ]
        if not due or deadline - now <= 0:
            return False
        await self._probe(due, min(self.discover_timeout, deadline - now))
        return any(ep.alive for ep in due)

    async def _send(self, topo, layer, inputs, part: ShardPart, deadline, md, depth=0, held=None):
        """One shard's part -> [Piece]: a live replica, the next one on a retryable
        failure, the same or another after a pause when it is busy (overload);
        when the shard has no replica left, its routes go to other owners."""
        request = None
        held = [] if held is None else held
        # Slots carry calls with the client's own credentials (checked when leased);
        # a call with its own token or metadata goes over gRPC, where they are checked.
        slots_ok = (
            self._slots_on and tuple(kv for kv in md if kv[0] != "x-request-id") == self._stream_md
        )
        rows = part.tokens.numel()
        tried: dict[str, str] = {}
        busy: dict[str, str] = {}  # replicas that refused for overload (kept in rotation)
        refusals = 0
        last, ep = None, None
        addresses = topo.shards[part.shard].addresses
        while len(tried) < self.max_attempts:
            # A replica that did not refuse, else the least loaded busy one.
            ep = self._pool.pick(addresses, {*tried, *busy}) or self._pool.pick(addresses, tried)
            remaining = deadline - time.monotonic()
            if ep is None or remaining <= 0:
                break
            # With another live replica to fall back on, an attempt gets a share of
            # the time left, so a replica that stalls (accepts, never answers) costs
            # part of the deadline, not all of it.
            backup = self._pool.has_live(addresses, {*tried, ep.address})
            budget = remaining * self.attempt_share if backup else remaining
            ep.outstanding += 1
            sent, span, failed = time.perf_counter_ns(), None, None
            if tracing.active():  # this attempt; the shard's spans become its children
                attrs = {"expertd.address": ep.address, "expertd.shard": part.shard}
                span = tracing.start("expertd.client.shard", {**attrs, "expertd.tokens": rows})
            try:
                slot = (
                    await self._slot(ep, min(budget, self.discover_timeout), rows)
                    if slots_ok
                    else None
                )
                if slot is not None:
                    held.append(slot)  # released after the sum, or when the call fails
                if slots_ok:  # leasing may have taken time: what is left of it
                    spent = remaining - (deadline - time.monotonic())
                    remaining, budget = remaining - spent, budget - spent
                    if budget <= 0:
                        raise StreamCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed")
                if slot is not None:
                    parent = tracing.traceparent(span) if span is not None else ""
                    piece = await self._forward_slot(
                        ep, slot, layer, inputs, part, budget, md, parent
                    )
                    ep.calls += 1
                    self.telemetry.answered(time.perf_counter_ns() - sent, piece.timing)
                    if span is not None:
                        span.set_attribute("expertd.transport", "slot")
                        span.set_attributes(transfer_attributes(sent, piece.timing))
                    return [piece]
                if request is None:
                    request = forward_request(layer, inputs, part)
                parent = tracing.traceparent(span) if span is not None else ""
                reply = await self._forward_rpc(ep, request, budget, md, parent)
                if span is not None and reply is not None:
                    span.set_attributes(transfer_attributes(sent, reply.timing))
            except grpc.RpcError as e:
                failed = e
                code, details = e.code(), e.details()
                last = (ep.address, code, details)
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _overload(ep, rows, details):
                    refusals += 1
                    busy[ep.address] = f"{code.name}: {details}"
                    pause = min(
                        self.busy_backoff * 2.0 ** (refusals - 1), BUSY_PAUSE_MAX
                    ) * random.uniform(0.5, 1.5)
                    left = deadline - time.monotonic()
                    if refusals > self.busy_retries or pause >= left:
                        why = f"server overloaded: {details} (refused {refusals} times)"
                        raise ShardCallError(
                            ep.address, layer, part.experts, code, why, {**tried, **busy}
                        ) from None
                    await asyncio.sleep(pause)
                    continue
                tried[ep.address] = f"{code.name}: {details}"
                stalled = code == grpc.StatusCode.DEADLINE_EXCEEDED and budget < remaining
                if code not in RETRYABLE and not stalled:
                    raise ShardCallError(
                        ep.address, layer, part.experts, code, details, {**busy, **tried}
                    ) from None
                if stalled:  # out of rotation until a probe gets an answer again
                    tried[ep.address] = f"no answer within {budget:.3g} s"
                    if ep.stream is not None:
                        ep.stream.close()
                        ep.stream = None
                if stalled or code not in KEEPS_REPLICA:
                    self._pool.mark_down(ep, tried[ep.address])
                pause = self.retry_backoff * 2 ** (len(tried) - 1) * random.uniform(0.5, 1.5)
                await asyncio.sleep(min(pause, max(deadline - time.monotonic(), 0)))
                continue
            except BaseException as e:
                failed = e
                raise
            finally:
                ep.outstanding -= 1
                if span is not None:
                    tracing.end(span, failed)
            problem = reply_problem(reply, rows, topo.hidden_size)
            if problem is not None:  # a server that does not speak the protocol: say so now
                raise ShardCallError(
                    ep.address, layer, part.experts, grpc.StatusCode.INTERNAL, problem
                )
            ep.calls += 1
            ep.last_timing = reply.timing
            self.telemetry.answered(time.perf_counter_ns() - sent, reply.timing)
            return [Piece(part.shard, part.tokens, reply.output, ep.address, ep.last_timing)]
        if ep is None and time.monotonic() < deadline and depth < len(topo.shards):
            subparts, lost = self._plan(topo, layer, part.topk_ids, part.topk_weights, {part.shard})
            if not lost:  # redundant experts: their other owners take the routes
                moved = [dataclasses.replace(p, tokens=part.tokens[p.tokens]) for p in subparts]
                pieces = await _all(
                    self._send(topo, layer, inputs, p, deadline, md, depth + 1, held) for p in moved
                )
                return [p for ps in pieces for p in ps]
        address = last[0] if last else topo.shards[part.shard].addresses[0]
        if time.monotonic() >= deadline:
            why = f"deadline passed; last: {last[2]}" if last else "deadline passed before sending"
            code = grpc.StatusCode.DEADLINE_EXCEEDED
            raise ShardCallError(address, layer, part.experts, code, why, {**busy, **tried} or None)
        if last is None:
            raise CoverageError(
                layer, part.experts, self._pool.down(self._owners(topo, layer, part.experts))
            )
        raise ShardCallError(address, layer, part.experts, last[1], last[2], {**busy, **tried})

    async def _forward_rpc(
        self, ep: Endpoint, request, timeout: float, md, traceparent: str = ""
    ) -> pb.ForwardResponse:
        """One Forward on the stream, or unary when asked to (or when this call's
        metadata differs from the stream's: a per-call token or extra metadata).
        traceparent: the attempt's span, in the request on a stream, else in metadata."""
        # The server refuses a request routed for another of its lives (a restart,
        # maybe with another placement) instead of skipping routes it lost.
        request.instance_id = ep.info.instance_id if ep.info is not None else ""
        call_md = tuple(kv for kv in md if kv[0] != "x-request-id")
        if self._rpc == "stream" and call_md == self._stream_md:
            if ep.stream is None:
                ep.stream = ForwardStream(ep.stub, self._stream_md)
            request.trace_id = dict(md).get("x-request-id", "")
            request.traceparent = traceparent
            return await ep.stream.forward(request, timeout)
        if traceparent:
            md = (*md, (tracing.TRACEPARENT, traceparent))
        return await ep.stub.Forward(request, timeout=timeout, metadata=md)

    def _owners(self, topo: Topology, layer: int, experts: list[int]) -> list[str]:
        """Addresses that own any of `experts` for `layer`, or whose placement is unknown."""
        wanted = set(experts)
        known = {
            a
            for shard in topo.shards
            if layer in shard.layers and wanted & set(shard.experts)
            for a in shard.addresses
        }
        return [a for a, ep in self._pool.endpoints.items() if a in known or ep.info is None]

    # -- lifetime ----------------------------------------------------------------------

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
        for ep in self._pool.endpoints.values():
            if ep.stream is not None:
                ep.stream.close()
            if ep.dataplane is not None:
                ep.dataplane.close()
                ep.dataplane = None
        if self._nixl_agent is not None:
            self._nixl_agent.close()
        await asyncio.gather(*(ep.channel.close() for ep in self._pool.endpoints.values()))

    async def __aenter__(self) -> AsyncExpertClient:
        if self.topology is None:
            await self.refresh()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _overload(ep: Endpoint, rows: int, details: str) -> bool:
    """Is a RESOURCE_EXHAUSTED from `ep` overload (retry later), not a request over
    its limits (retrying cannot help)? Judged by the limits its Describe gave."""
    info = ep.info
    if "larger than max" in details:  # gRPC's own message size limit
        return False
    if info is not None and info.max_tokens_per_request and rows > info.max_tokens_per_request:
        return False
    if info is not None and info.max_message_bytes:
        size = rows * (2 * info.hidden_size + 8 * max(info.top_k, 1))  # about the request's
        if size > info.max_message_bytes:
            return False
    return True


def reply_problem(reply, rows: int, hidden_size: int) -> str | None:
    """What is wrong with a Forward answer that came with status OK, or None: the
    SDK never lets a reply it cannot sum reach the caller as anything but an error."""
    if reply is None:
        return "malformed reply: the answer could not be decoded as a ForwardResponse"
    if reply.HasField("error"):
        code = _CODES.get(reply.error.code)
        name = code.name if code is not None else f"status {reply.error.code}"
        return f"malformed reply: status OK but an error inside: {name}: {reply.error.message}"
    if not reply.HasField("output"):
        return "malformed reply: no output tensor"
    out = reply.output
    shape = list(out.shape)
    if out.dtype != pb.BF16:
        return f"malformed reply: output dtype {out.dtype}, expected BF16 ({pb.BF16})"
    if shape != [rows, hidden_size]:
        return f"malformed reply: output shape {shape}, expected [{rows}, {hidden_size}]"
    if len(out.data) != rows * hidden_size * 2:
        return (
            f"malformed reply: output holds {len(out.data)} bytes, "
            f"expected {rows * hidden_size * 2} for bf16 [{rows}, {hidden_size}]"
        )
    return None


_CODES = {c.value[0]: c for c in grpc.StatusCode}


async def _all(coros):
    """gather, but a failure cancels the siblings (their calls end at once). A lone
    coroutine is awaited as it is: no task, no gather (two event-loop turns fewer)."""
    coros = list(coros)
    if len(coros) == 1:
        return [await coros[0]]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
