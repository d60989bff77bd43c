"""The expertd.v1.ExpertService servicer (grpc.aio).

A request is viewed over its received bytes, validated on a small prep pool
(shape, dtype, ids: in parallel with compute), then queued on the batcher,
which merges it with concurrent requests of the same layer and runs the forward
on the one compute thread. The event loop only moves bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

import expertd
from expertd import cudamem, nixl, rawtcp, tracing
from expertd import dataplane as dp
from expertd.server import remote, slots, tcpslots
from expertd.server.bank import ExpertBank
from expertd.server.batcher import Batcher, BatchPolicy, Job, Overloaded
from expertd.server.lane import Lane
from expertd.server.metrics import Metrics
from expertd.server.runner import BatchRunner
from expertd.server.validate import Limits, RequestError, check_forward, parse_forward
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import expertd_pb2_grpc as pb_grpc

log = logging.getLogger("expertd.server")

# Requests of one stream read but not yet answered on the wire. Admission is the
# server's (max_inflight, the batcher's queue limits): a stream reads on while its
# requests are admitted or refused at once, so one stream's backlog never sits
# unread in HTTP/2 buffers, where its deadlines would pass unseen (the server
# dates a stream request's deadline from when it reads it). The window only
# stops a client that does not read its answers.
STREAM_WINDOW = 1024
# gRPC core's own limit on calls received but not yet handed to the service. Core
# refuses calls past it with CANCELLED before the service sees them (uncounted);
# set far above max_inflight, so overload is the service's RESOURCE_EXHAUSTED.
PENDING_RPCS_MIN = 8192
OVERLOAD_LOG_S = 1.0  # overload refusals are logged at most once per this, with a count
# Requests up to this many tokens are validated on the event loop (tens of us);
# larger ones on the prep pool, so the loop never stalls on a big scan.
INLINE_ROWS = 64


def _rows(req) -> int:
    shape = req.hidden_states.shape if req.HasField("hidden_states") else []
    return shape[0] if len(shape) == 2 and shape[0] >= 0 else INLINE_ROWS + 1


def server_options(max_inflight: int) -> list[tuple[str, int]]:
    """grpc.aio server options of the admission design (see PENDING_RPCS_MIN)."""
    pending = max(PENDING_RPCS_MIN, 16 * max_inflight)
    return [
        ("grpc.server.max_pending_requests", pending),
        ("grpc.server.max_pending_requests_hard_limit", pending),
    ]


def traceparent_of(context) -> str:
    """The W3C traceparent in a unary call's metadata ("" if none)."""
    for key, value in context.invocation_metadata() or ():
        if key == tracing.TRACEPARENT:
            return value
    return ""


def request_id_of(context, fallback: int = 0) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id":
            return value
    return str(fallback)


class ExpertServicer(pb_grpc.ExpertServiceServicer):
    def __init__(
        self,
        limits: Limits,
        policy: BatchPolicy,
        metrics: Metrics,
        shard_index: int = 0,
        num_shards: int = 1,
        max_inflight: int = 512,
        pin_slots: bool = True,
        lane: bool = True,
    ) -> None:
        self.limits = limits
        self.policy = policy
        self.metrics = metrics
        self.bank: ExpertBank | None = None  # None while loading
        self.batcher: Batcher | None = None
        self._drain = asyncio.Event()  # set when draining starts: open streams end
        self._loop = asyncio.get_event_loop()
        self.max_inflight = max_inflight
        self._inflight = 0
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expertd-compute")
        self._prep = ThreadPoolExecutor(max_workers=2, thread_name_prefix="expertd-prep")
        self._shard = (shard_index, num_shards)
        self._pin_slots = pin_slots
        self._lane_on = lane
        self.lane: Lane | None = None  # small cuda-ipc slot calls (server/lane.py)
        self._instance = uuid.uuid4().hex  # new for every process start
        self._overload_logged = 0.0  # monotonic time of the last overload log line
        self._overload_quiet = 0  # overload refusals since then, not logged
        # The same-host data plane (server/slots.py); None where this OS has none.
        self.slots: slots.SlotRegistry | None = (
            slots.SlotRegistry(self, self._instance, pin=pin_slots) if dp.available() else None
        )
        # The cross-host data plane (server/remote.py); None without NIXL installed.
        self.remote: remote.RemoteRegistry | None = (
            remote.RemoteRegistry(self, self._instance) if nixl.installed() else None
        )
        # Slots over raw TCP connections (server/tcpslots.py): opened by `open_tcp`.
        self.tcp: tcpslots.TcpRegistry | None = None

    def open_tcp(self, host: str, port: int, receive_timeout_s: float) -> int:
        """Listen for tcp data plane connections on host:port (0: any free port) -> the port."""
        self.tcp = tcpslots.TcpRegistry(self, host, port, receive_timeout_s, self._pin_slots)
        return self.tcp.port

    @property
    def draining(self) -> bool:
        return self._drain.is_set()

    @draining.setter
    def draining(self, value: bool) -> None:
        """Start (or stop) draining: new calls are refused, open streams end."""
        change = self._drain.set if value else self._drain.clear
        try:
            running = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            running = False
        if running:
            change()
        else:  # from another thread (embedding, tests): done when this returns

            async def apply() -> None:
                change()

            asyncio.run_coroutine_threadsafe(apply(), self._loop).result(10)

    def attach(self, bank: ExpertBank, runner: BatchRunner) -> None:
        """Start serving `bank` through `runner` (on the event loop's thread)."""
        self.bank = bank
        self.batcher = Batcher(runner, self._compute, self.metrics, self.policy)
        self.batcher.start()
        if self._lane_on:
            self.lane = Lane.for_runner(self, runner, self.batcher, bank.info.num_experts)
        self.metrics.resident_bytes.set(bank.resident_bytes)
        self.metrics.watch_device(bank.backend.device)
        cuda = bank.backend.device.type == "cuda"
        self.metrics.gpu_mps.set(1 if cuda and cudamem.mps_control_pipe() else 0)

    async def close(self) -> None:
        if self.slots is not None:
            self.slots.close()
        if self.remote is not None:
            self.remote.close()
        if self.tcp is not None:
            self.tcp.close()
        if self.batcher is not None:
            await self.batcher.stop()
        self._compute.shutdown(wait=True)
        self._prep.shutdown(wait=True)

    def admit(self) -> ExpertBank:
        """The bank, if a call may be admitted now (any thread); RequestError if not."""
        return self._admit()

    def _admit(self) -> ExpertBank:
        if self.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "server is draining")
        if self.bank is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "server is still loading its experts")
        if self._inflight >= self.max_inflight:
            self.metrics.overload.labels("inflight").inc()
            raise Overloaded(
                f"server overloaded: {self._inflight} requests in flight (limit {self.max_inflight})"
            )
        return self.bank

    async def _forward(
        self, req: pb.ForwardRequest, deadline: float | None, traceparent: str = ""
    ) -> pb.ForwardResponse:
        """One request, admitted, validated, batched; raises RequestError."""
        received = time.perf_counter_ns()
        bank = self._admit()
        if req.instance_id and req.instance_id != self._instance:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"request routed for server instance {req.instance_id}, but this is "
                f"{self._instance} (restarted): describe it again",
            )
        self._inflight += 1
        self.metrics.inflight.set(self._inflight)
        try:
            loop = asyncio.get_running_loop()
            if _rows(req) <= INLINE_ROWS:  # small: a thread hop costs more than the checks
                args = parse_forward(req, bank.info, self.limits, bank.has_layer)
            else:
                args = await loop.run_in_executor(
                    self._prep, parse_forward, req, bank.info, self.limits, bank.has_layer
                )
            job = Job(args, deadline, received, None, req.request_id)
            job.traceparent = req.traceparent or traceparent
            reply = self.batcher.run_now(job)  # a small one, the batcher idle: answered here
            if reply is not None:
                return reply
            job.future = loop.create_future()
            self.batcher.submit(job)
            return await job.future  # the serialized ForwardResponse (codec)
        finally:
            self._inflight -= 1
            self.metrics.inflight.set(self._inflight)

    # -- calls arriving through a shared-memory slot (server/slots.py) -----------------

    def take_slot_call(self, slot, lease_id: str, take, *args) -> None:
        """Run `take(*args)` (read, check and start a slot's call, any transport); a
        refusal or a failure in it is written into the slot as the call's answer."""
        try:
            take(*args)
        except RequestError as e:
            self.count_slot(e.code)
            slot.write_error(e.code, e.message)
        except Exception:
            log.exception("slot call failed (lease %s)", lease_id)
            self.count_slot(grpc.StatusCode.INTERNAL)
            slot.write_error(grpc.StatusCode.INTERNAL, "internal error in forward")

    def run_slot_call(
        self, slot, bank, layer, x, ids, w, timeout_us, request_id, received, trace=None
    ):
        """A call read from a slot of any transport (its thread): checked as Forward
        is, then run on that thread when the batcher is idle (answered when this
        returns), else queued on the event loop. RequestError for a refused call.
        trace: the caller's span as the slot carried it (tracing.context_fields)."""
        args = check_forward(layer, x, ids, w, bank.info, self.limits, bank.has_layer)
        deadline = time.monotonic() + timeout_us / 1e6 if timeout_us else None
        job = Job(args, deadline, received, None, request_id, slot)
        if trace is not None and tracing.active():
            job.traceparent = tracing.from_fields(*trace)
        if self.batcher.run_direct(job):
            self.count_slot(grpc.StatusCode.OK)
            return
        self.submit_threadsafe(job)

    def submit_threadsafe(self, job: Job) -> None:
        """Queue a checked slot call (job.sink: its slot) from the slot's waiter thread."""
        self._loop.call_soon_threadsafe(self._submit_slot, job)

    def _submit_slot(self, job: Job) -> None:
        """On the event loop: admitted and queued like a Forward; the answer goes
        straight into the slot (Job.sink), errors through the job's future."""
        slot = job.sink
        try:
            self._admit()
            self._inflight += 1
            self.metrics.inflight.set(self._inflight)
            job.future = self._loop.create_future()
            slots.answer_later(job.future, slot, self)
        except RequestError as e:
            self.count_slot(e.code)
            slot.write_error(e.code, e.message)
            return
        try:
            self.batcher.submit(job)
        except RequestError as e:
            job.future.set_exception(e)

    def release_inflight(self) -> None:
        self._inflight -= 1
        self.metrics.inflight.set(self._inflight)

    def dataplanes(self) -> list[str]:
        """The data planes this server offers besides gRPC."""
        offered = self.slots.offered() if self.slots is not None else []
        if self.tcp is not None:
            offered.append(rawtcp.TCP)
        return offered + ([nixl.NIXL] if self.remote is not None else [])

    def count_slot(self, code: grpc.StatusCode) -> None:
        self._count("Slot", code)

    def count_slot_ok(
        self, tokens: int, queue_ns: int, compute_ns: int, in_bytes: int, out_bytes: int
    ) -> None:
        """The books of a slot call the lane answered (server/lane.py): what the batcher
        records for a batch of one call, and the call."""
        m = self.metrics
        self._count("Slot", grpc.StatusCode.OK)
        m.lane_calls.inc()
        m.tokens.inc(tokens)
        m.batch_tokens.observe(tokens)
        m.batch_requests.observe(1)
        m.queue_seconds.observe(queue_ns / 1e9)
        m.compute_seconds.observe(compute_ns / 1e9)
        m.request_seconds.observe((queue_ns + compute_ns) / 1e9)
        m.request_bytes.observe(in_bytes)
        m.response_bytes.observe(out_bytes)

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        self.metrics.requests.labels(method, code.name).inc()

    def _log_refusal(self, rid: str, e: RequestError) -> None:
        """One line per refusal, except overload: at most one line per OVERLOAD_LOG_S
        with how many went unlogged (a flood's refusals must stay cheap)."""
        if isinstance(e, Overloaded):
            now = time.monotonic()
            if now - self._overload_logged < OVERLOAD_LOG_S:
                self._overload_quiet += 1
                return
            quiet, self._overload_quiet, self._overload_logged = self._overload_quiet, 0, now
            more = f" (and {quiet} more refusals for overload since the last line)" if quiet else ""
            log.warning("refused request %s: %s%s", rid, e.message, more, extra={"request_id": rid})
            return
        log.info(
            "refused request %s: %s: %s", rid, e.code.name, e.message, extra={"request_id": rid}
        )

    # -- RPCs ------------------------------------------------------------------------

    async def Forward(self, request, context):
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        try:
            parent = traceparent_of(context) if tracing.active() else ""
            reply = await self._forward(request, deadline, parent)
        except RequestError as e:
            self._count("Forward", e.code)
            self._log_refusal(request_id_of(context, request.request_id), e)
            await context.abort(e.code, e.message)
        except Exception:  # a bug of ours, never the client's fault: say so, keep serving
            self._count("Forward", grpc.StatusCode.INTERNAL)
            rid = request_id_of(context, request.request_id)
            log.exception("forward failed (request %s)", rid, extra={"request_id": rid})
            await context.abort(grpc.StatusCode.INTERNAL, "internal error in forward")
        self._count("Forward", grpc.StatusCode.OK)
        return reply

    async def ForwardStream(self, request_iterator, context):
        """Reads requests in order and answers each as soon as it is computed, in any
        order (request_id tells them apart). The reading runs in this call's own task
        and each answer is written by its request's task, under a lock (one write at a
        time on a stream): no task or queue stands between a message and its handling,
        each of which costs an event-loop turn (~30-90 us on a busy 2-CPU host)."""
        window = asyncio.Semaphore(STREAM_WINDOW)  # requests read, not yet answered
        writing = asyncio.Lock()
        tasks: set[asyncio.Task] = set()

        async def one(req: pb.ForwardRequest) -> None:
            try:
                deadline = time.monotonic() + req.timeout_us / 1e6 if req.timeout_us else None
                resp = await self._forward(req, deadline)
                self._count("ForwardStream", grpc.StatusCode.OK)
            except RequestError as e:
                self._count("ForwardStream", e.code)
                self._log_refusal(req.trace_id or str(req.request_id), e)
                resp = pb.ForwardResponse(
                    request_id=req.request_id,
                    error=pb.Error(code=e.code.value[0], message=e.message),
                )
            except Exception:
                log.exception("stream forward failed (request_id=%d)", req.request_id)
                self._count("ForwardStream", grpc.StatusCode.INTERNAL)
                code = grpc.StatusCode.INTERNAL.value[0]
                resp = pb.ForwardResponse(
                    request_id=req.request_id, error=pb.Error(code=code, message="internal error")
                )
            try:
                async with writing:
                    await context.write(resp)
            except Exception as e:  # the stream is gone: its reading ends too
                log.debug("stream answer not written (request_id=%d): %s", req.request_id, e)
            finally:
                window.release()  # answered on the wire (or the stream is gone)

        # Until the client half-closes, or the server starts draining: then the requests
        # already read finish, and the stream ends (OK), so a client holding a stream
        # open does not hold up shutdown; what it sends after that is never read, and
        # it retries those elsewhere. Draining interrupts a read under way, and only a
        # read: a request already read is always answered.
        me = asyncio.current_task()
        reading = False
        interrupted = False

        def drained(_f: asyncio.Future) -> None:
            nonlocal interrupted
            if reading and not interrupted:
                interrupted = True
                me.cancel()

        draining = asyncio.ensure_future(self._drain.wait())
        draining.add_done_callback(drained)
        requests = aiter(request_iterator)
        try:
            while not self._drain.is_set():
                reading = True
                try:
                    req = await anext(requests)
                except StopAsyncIteration:
                    break
                except asyncio.CancelledError:
                    if not interrupted:
                        raise
                    me.uncancel()
                    break
                finally:
                    reading = False
                await window.acquire()
                task = asyncio.ensure_future(one(req))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except asyncio.CancelledError:  # the call itself ended: nobody to answer
            for task in tasks:
                task.cancel()
            raise
        finally:  # also when reading failed (e.g. an undecodable message): that error
            # reaches the caller once the requests read so far are answered
            draining.cancel()
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)

    async def RegisterSlots(self, request, context):
        tcp = request.transport == rawtcp.TCP
        if (self.tcp if tcp else self.slots) is None:
            what = "tcp" if tcp else "same-host"
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"this server offers no {what} data plane"
            )
        if self.bank is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is still loading its experts")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining")
        hidden = self.bank.info.hidden_size
        try:
            if tcp:
                token, lease_id, layout = self.tcp.book(
                    request.slots, request.max_tokens, request.top_k, hidden
                )
            else:
                token, lease_id, layout = self.slots.book(
                    request.transport, request.slots, request.max_tokens, request.top_k, hidden
                )
        except RequestError as e:
            self._count("RegisterSlots", e.code)
            await context.abort(e.code, e.message)
        self._count("RegisterSlots", grpc.StatusCode.OK)
        return pb.RegisterSlotsResponse(
            socket_name="" if tcp else self.slots.name,
            token=token,
            lease_id=lease_id,
            layout=layout.to_proto(pb),
            instance_id=self._instance,
            slots=request.slots or 1,
            data_port=self.tcp.port if tcp else 0,
        )

    async def RegisterRemoteSlots(self, request, context):
        """Register a caller's NIXL slots; the stream is the lease (server/remote.py)."""
        if self.remote is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this server offers no cross-host data plane (NIXL is not installed)",
            )
        if self.bank is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is still loading its experts")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining")
        hidden = self.bank.info.hidden_size
        try:
            lease, reply = await self._loop.run_in_executor(
                self._prep, self.remote.register, request, hidden
            )
        except RequestError as e:
            self._count("RegisterRemoteSlots", e.code)
            await context.abort(e.code, e.message)
        except RuntimeError as e:  # NIXL could not start here
            self._count("RegisterRemoteSlots", grpc.StatusCode.FAILED_PRECONDITION)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"NIXL: {e}")
        self._count("RegisterRemoteSlots", grpc.StatusCode.OK)
        try:
            yield reply
            await self.remote.hold(lease, self._drain)
        finally:
            self.remote.release(lease)

    async def Describe(self, request, context):
        if self.bank is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is still loading its experts")
        bank = self.bank
        info = bank.info
        device = bank.backend.device
        device_name = str(device)
        if device.type == "cuda":
            mps = "; MPS" if cudamem.mps_control_pipe() else ""
            device_name += f" ({torch.cuda.get_device_name(device)}{mps})"
        return pb.DescribeResponse(
            version=expertd.__version__,
            backend=bank.backend.name,
            device=device_name,
            hidden_size=info.hidden_size,
            intermediate_size=info.intermediate_size,
            num_experts=info.num_experts,
            top_k=info.top_k,
            layers=list(info.layers),
            experts=list(info.experts),
            weight_dtype="nvfp4",
            activation_dtype=pb.BF16,
            output_dtype=pb.BF16,
            model=info.source,
            instance_id=self._instance,
            max_tokens_per_request=self.limits.max_tokens,
            max_message_bytes=self.limits.max_message_bytes(info.hidden_size),
            shard_index=self._shard[0],
            num_shards=self._shard[1],
            dataplanes=self.dataplanes(),
        )
