"""Cross-request batching: concurrent requests for the same layer (from any
number of frontends) become one forward, so each expert's weights are read once
for all of them.

One asyncio task owns the queue. Once one of the runner's slots is free it
takes the oldest request, optionally waits up to `window_s` (counted from that
request's arrival) for more of the same layer, takes that layer's queued
requests in arrival order up to `max_batch_tokens`, and launches them on the
compute thread; requests for other layers keep their place. With
`window_s = 0` nothing waits: requests that arrived while the slots were busy
are merged, which costs no latency.

On a GPU the runner has two slots: while one batch computes, the next is
gathered and copied in, and a finisher thread waits for the first one's results
and writes its responses (server/runner.py). On CPU there is one slot and the
compute thread does it all, one batch at a time.

A small batch on a GPU with nothing else in flight runs on the event loop's
thread itself: gathered, launched (one graph replay), waited for and answered
there. The GPU part of such a batch is tens of microseconds (~200 us at 16
tokens of muse-spark), less than the two thread hand-offs it saves (loop ->
compute thread -> loop: ~240 us on the H200 host, benchmarks/rpc_floor.py);
requests that arrive meanwhile wait in gRPC's queue and form the next batch.
A CPU shard does the same while its small batches have recently taken at most
INLINE_CPU_MAX_S each (its compute is one batch at a time anyway; other calls wait
at most that long to be read). A gRPC request that finds the batcher idle this way
is run in its own handler (`run_now`), without the queue and the batcher's task in
between.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import torch

from expertd import tracing
from expertd.codec import encode_forward_response
from expertd.dataplane import Recent
from expertd.server.metrics import Metrics
from expertd.server.runner import FUSED_ROWS, LANE_SLOT, BatchRunner, Flight
from expertd.server.validate import ForwardArgs, RequestError, invalid
from expertd.v1 import expertd_pb2 as pb

SENT = b""  # a Job's result when its sink took the answer

# Batches of up to this many tokens run on the event loop when nothing else is in
# flight on the GPU (see above); 0 turns that off.
INLINE_TOKENS = 16
# On a CPU shard, only while the last few such batches each took at most this long.
INLINE_CPU_MAX_S = 5e-3

# A slot call that finds another slot call running on its thread (run_direct) waits
# this long for it before queueing on the event loop (whose hand-offs cost more).
DIRECT_WAIT_S = 250e-6


class Overloaded(RequestError):
    """RESOURCE_EXHAUSTED for overload (a limit on requests waiting or in flight,
    not one on the request itself): the client may retry later."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{message}: retry later")


@dataclass(slots=True)
class Job:
    args: ForwardArgs
    deadline: float | None  # time.monotonic() value, or None
    received_ns: int  # time.perf_counter_ns() at arrival
    future: asyncio.Future | None  # None: answered by its sink, or by run_now
    request_id: int = 0  # echoed in the response
    # Where the answer goes instead of a response message: a shared-memory slot
    # (server/slots.py) that takes the output rows and the timing on the finisher's
    # thread and wakes its client there; the future then gets SENT.
    sink: Any = None
    traceparent: str = ""  # the caller's span (W3C), when it sent one
    tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = self.args.x.shape[0]


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    window_s: float = 0.0  # how long the oldest request may wait for company
    max_batch_tokens: int = 16384  # tokens per merged forward
    max_batch_requests: int = 256  # requests per merged forward (1: no batching)
    max_queue_requests: int = 1024  # waiting requests before RESOURCE_EXHAUSTED
    max_queue_tokens: int = 65536  # waiting tokens before RESOURCE_EXHAUSTED


class Batcher:
    def __init__(
        self, runner: BatchRunner, compute: Executor, metrics: Metrics, policy: BatchPolicy
    ) -> None:
        self.runner = runner
        self.compute = compute
        self.metrics = metrics
        self.policy = policy
        self._queue: deque[Job] = deque()
        self._queued_tokens = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.computing = 0  # tokens of the batches in flight (launched, not yet answered)
        self._running_direct = False  # a call runs on its slot's thread (run_direct)
        # compute time (s) of the last batches of at most INLINE_TOKENS (a CPU's _here);
        # any thread finishes batches, the loop's reads it (Recent writes in place)
        self._small = Recent()
        self._slots = asyncio.Semaphore(runner.depth)  # batches in flight <= runner's slots
        self._flights: set[asyncio.Task] = set()
        # Waits for batches on the device and writes their responses, while the compute
        # thread launches the next batch (only used when the runner overlaps batches).
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expertd-finish")
        # Held while a batch is being launched, and for the whole of a direct run (below):
        # a direct run takes a runner slot only when one is free and nothing else launches.
        self._gate = threading.Lock()

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*self._flights, return_exceptions=True)  # launched: let them end
        self._finisher.shutdown(wait=True)
        for job in self._queue:
            if not job.future.done():
                job.future.set_exception(
                    RequestError(grpc.StatusCode.UNAVAILABLE, "server stopped")
                )
        self._queue.clear()

    def submit(self, job: Job) -> None:
        """Queue a validated request, or refuse it when the queue is full."""
        p = self.policy
        full = len(self._queue) >= p.max_queue_requests
        if full or (self._queue and self._queued_tokens + job.tokens > p.max_queue_tokens):
            self.metrics.overload.labels("queue_requests" if full else "queue_tokens").inc()
            raise Overloaded(
                f"server queue full: {len(self._queue)} requests / {self._queued_tokens} tokens "
                f"waiting (limits {p.max_queue_requests} / {p.max_queue_tokens})"
            )
        self._queue.append(job)
        self._queued_tokens += job.tokens
        self.metrics.queued_tokens.set(self._queued_tokens)
        self._wake.set()

    def run_direct(self, job: Job) -> bool:
        """Run `job` on the calling thread now, if the batcher is idle: nothing queued,
        nothing computing, a runner slot free, no launch under way. -> False (nothing
        done) otherwise: the caller queues it with `submit` on the event loop.

        For calls arriving on a thread of their own (a shared-memory slot's waiter,
        server/slots.py): a lone call then costs no hand-off to the event loop and on
        to the compute thread (two thread wake-ups), and a call arriving meanwhile
        finds the gate taken and is queued, where it batches with others as usual.
        The job's sink takes the answer; an error is raised to the caller."""
        return self._alone(job, wait=True) is not None

    def run_now(self, job: Job) -> bytes | None:
        """On the event loop, for a request read there (gRPC): run `job` in its handler
        now when the batcher's own loop would run it on this thread as a batch of one
        (idle, small: `_here`), without that loop's task in between (a queue hand-off
        and two task switches). -> its response bytes; None (nothing done): queue it.
        An error is raised to the caller."""
        if self.policy.window_s > 0 or not self._here(job.tokens):
            return None  # a window waits for company; a large or slow batch is threaded
        return self._alone(job, wait=False)

    def _alone(self, job: Job, wait: bool):
        """Run `job` as a batch of one on this thread if the batcher is idle -> its
        result (SENT when its sink took it); None, nothing done, if not idle. `wait`:
        wait a moment for a gate held by another lone call (never on the event loop)."""
        if self._queue or self.computing:
            return None
        # Another direct call holding the gate is most likely answering already (a
        # caller's stream rings the next call the moment the last one's rows are in its
        # slot, before this host has answered it): waiting a moment for it costs less
        # than the event loop's two hand-offs.
        if not self._gate.acquire(blocking=False) and (
            not wait or not self._running_direct or not self._gate.acquire(timeout=DIRECT_WAIT_S)
        ):
            return None
        try:
            if self._queue or self.computing or self.runner.free_slots < 1:
                return None
            if job.deadline is not None and time.monotonic() >= job.deadline:
                raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed")
            started = time.perf_counter_ns()
            self._running_direct = True
            result = self._finish([job], self._start([job]), started)[0]
        finally:
            self._running_direct = False
            self._gate.release()
        if isinstance(result, Exception):
            raise result
        return result

    def take_lone(self) -> int | None:
        """For a call run outside the batcher on its own thread (server/lane.py): the
        batcher's gate and runner slot LANE_SLOT when the batcher is idle (as
        run_direct would run it) -> that slot's index, held until `give_lone`; None:
        queue the call as usual. One slot does: the gate lets one such call run at a
        time, so the lane's graphs exist for that slot only."""
        if self._queue or self.computing:
            return None
        if not self._gate.acquire(blocking=False) and (
            not self._running_direct or not self._gate.acquire(timeout=DIRECT_WAIT_S)
        ):
            return None
        if self._queue or self.computing or not self.runner.take_slot(LANE_SLOT):
            self._gate.release()
            return None
        self._running_direct = True
        return LANE_SLOT

    def give_lone(self, index: int) -> None:
        """Hand back what `take_lone` gave, once the call's GPU work has finished."""
        self.runner.give_slot(index)
        self._running_direct = False
        self._gate.release()

    # -- the loop ------------------------------------------------------------------

    def _layer_tokens(self, layer: int) -> int:
        return sum(j.tokens for j in self._queue if j.args.layer == layer)

    async def _wait_for_company(self, head: Job) -> None:
        limit = head.received_ns / 1e9 + self.policy.window_s
        while self._layer_tokens(head.args.layer) < self.policy.max_batch_tokens:
            remaining = limit - time.perf_counter_ns() / 1e9
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except TimeoutError:
                return

    def _take(self, layer: int) -> list[Job]:
        """Pop `layer`'s jobs in arrival order up to the token cap (at least one)."""
        batch, rest, tokens = [], deque(), 0
        for job in self._queue:
            fits = (
                tokens + job.tokens <= self.policy.max_batch_tokens
                and len(batch) < self.policy.max_batch_requests
            )
            # a batch is all host tensors or all device ones (cuda-ipc slots' x)
            same = not batch or job.args.x.is_cuda == batch[0].args.x.is_cuda
            if job.args.layer == layer and (not batch or (fits and same)):
                batch.append(job)
                tokens += job.tokens
            else:
                rest.append(job)
        self._queue = rest
        self._queued_tokens -= tokens
        self.metrics.queued_tokens.set(self._queued_tokens)
        return batch

    async def _next_batch(self) -> list[Job]:
        """Wait for requests; -> the next batch's live jobs (expired ones refused)."""
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            head = self._queue[0]
            if self.policy.window_s > 0:
                await self._wait_for_company(head)
            now = time.monotonic()
            live = []
            for job in self._take(head.args.layer):
                if job.future.done():  # the caller went away
                    continue
                if job.deadline is not None and now >= job.deadline:
                    job.future.set_exception(
                        RequestError(
                            grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while queued"
                        )
                    )
                    continue
                live.append(job)
            if live:
                return live

    async def _loop(self) -> None:
        """Take a batch whenever a slot is free (so batches form as late as they can),
        launch it on the compute thread, and deliver its results when they are in."""
        loop = asyncio.get_running_loop()
        while True:
            await self._slots.acquire()
            try:
                live = await self._next_batch()
            except BaseException:
                self._slots.release()
                raise
            tokens = sum(j.tokens for j in live)
            if self._here(tokens):
                self._run_here(live)
                continue
            self.computing += tokens
            launched = loop.run_in_executor(self.compute, self._launch, live)
            task = asyncio.ensure_future(self._deliver(live, tokens, launched))
            self._flights.add(task)
            task.add_done_callback(self._flights.discard)

    async def _deliver(self, jobs: list[Job], tokens: int, launched: asyncio.Future) -> None:
        try:
            done = await launched
            # finished on the compute thread (the usual case): no second hop to this loop
            results = done.result() if done.done() else await asyncio.wrap_future(done)
        except Exception as e:  # a bug or a device fault: every caller of the batch hears it
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(e)
            return
        finally:
            self.computing -= tokens
            self._slots.release()
        _settle(jobs, results)

    def _here(self, tokens: int) -> bool:
        """Run this batch on the loop's thread: small, nothing else in flight (so the
        compute thread is idle and the device has only this batch to do), on a GPU or
        on a CPU whose recent small batches were short (INLINE_CPU_MAX_S)."""
        if tokens > INLINE_TOKENS or self.computing:
            return False
        if self.runner.device.type == "cuda":
            return True
        return 0.0 < self._small.high() <= INLINE_CPU_MAX_S

    def _run_here(self, jobs: list[Job]) -> None:
        """Launch, wait, answer on this thread; the slot is free again on return."""
        started = time.perf_counter_ns()
        try:
            with self._gate:
                flight = self._start(jobs)
            results = self._finish(jobs, flight, started)
        except Exception as e:  # a bug or a device fault: every caller of the batch hears it
            results = [e] * len(jobs)
        finally:
            self._slots.release()
        _settle(jobs, results)

    # -- on the compute thread, then the finisher ---------------------------------

    def _launch(self, jobs: list[Job]) -> Future:
        """Start the merged forward; -> a future of one response (or error) per job.

        With several slots and requests waiting in the queue, the batch is finished
        (waited for, answered) on the finisher thread, so the compute thread is free
        to launch the next one meanwhile. With one slot (the CPU's default), nothing
        left to wait for (no tokens), or nothing queued behind it, it is finished
        right here, in the same hop: a lone request skips the thread hand-off (160 us
        of device time at M = 1 on the H200 host, benchmarks/latency.py, depth 2 vs 1).
        The queue is read without the event loop's lock: a request that arrives just
        after the check waits for this batch, as with one slot."""
        started = time.perf_counter_ns()
        with self._gate:
            flight = self._start(jobs)
        if flight.done or self.runner.depth == 1 or not self._queue:
            done: Future = Future()
            try:
                done.set_result(self._finish(jobs, flight, started))
            except Exception as e:
                done.set_exception(e)
            return done
        try:
            return self._finisher.submit(self._finish, jobs, flight, started)
        except BaseException:
            flight.release()
            raise

    def _start(self, jobs: list[Job]) -> Flight:
        args = [j.args for j in jobs]
        outs = bells = None
        # cuda-ipc slots (x on the device) or page-locked host slots: the runner copies
        # x from and the rows into the callers' slots itself
        if args[0].x.is_cuda or self._direct(jobs):
            outs = [j.sink.device_out(j.tokens) for j in jobs]
            if any(o is None for o in outs):  # a host slot the driver would not lock
                outs = None
            elif args[0].x.is_cuda:  # calls queued on their clients' streams
                bells = [j.sink.stream_bell() for j in jobs]
        return self.runner.launch(
            args[0].layer,
            [a.x for a in args],
            [a.ids for a in args],
            [a.weights for a in args],
            outs,
            bells,
        )

    def _direct(self, jobs: list[Job]) -> bool:
        """Whether a host batch is copied straight between the callers' slots and the
        GPU: every job's sink can take its rows in place, and the batch is past the
        fused graphs' size (below it one packed copy in the graph costs less than a
        copy per job)."""
        if self.runner.device.type != "cuda":
            return False
        if sum(j.tokens for j in jobs) <= FUSED_ROWS:
            return False
        return all(j.sink is not None and getattr(j.sink, "direct", False) for j in jobs)

    def _finish(self, jobs: list[Job], flight: Flight, started: int):
        """Wait for the batch's results, then one serialized response (or error) per
        job, written straight from the slot's output buffer; frees the slot."""
        done = []  # per job: when its answer was ready (perf_counter_ns), 0 if refused
        try:
            result = flight.wait()
            computed = time.perf_counter_ns()
            stage = flight.stage_ns
            batch_tokens = sum(j.tokens for j in jobs)
            if batch_tokens <= INLINE_TOKENS:
                self._small.add((computed - started) / 1e9)
            results, row = [], 0
            for job in jobs:
                rows = job.tokens
                if rows and result.bad_rows[row : row + rows].any():
                    if flight.placed:  # the rows are in the slot (device or pinned memory)
                        dev = job.sink.device_out(rows).cpu()
                        out_bits = dev.view(torch.int16).numpy().view(np.uint16)
                    else:
                        out_bits = result.out_bytes[row : row + rows]
                    error, cause = _not_finite(job.args, out_bits)
                    self.metrics.nonfinite.labels(cause).inc()
                    results.append(error)
                    done.append(0)
                else:
                    timing = {
                        "queue_us": (started - job.received_ns) // 1000,
                        "compute_us": (computed - started) // 1000,
                        "total_us": (time.perf_counter_ns() - job.received_ns) // 1000,
                        "stage_us": stage // 1000,
                        "device_us": (computed - started - stage) // 1000,
                        "batch_requests": len(jobs),
                        "batch_tokens": batch_tokens,
                    }
                    payload = result.out_bytes[row : row + rows]  # copied once, into the bytes
                    if job.sink is not None:  # into the client's slot, and ring it
                        job.sink.write_output(payload, timing, flight.placed)
                        results.append(SENT)
                        done.append(time.perf_counter_ns())
                        row += rows
                        continue
                    timing = pb.Timing(**timing)
                    shape = (rows, self.runner.hidden)
                    results.append(
                        encode_forward_response(job.request_id, pb.BF16, shape, payload, timing)
                    )
                    done.append(time.perf_counter_ns())
                row += rows
        finally:
            flight.release()
        m = self.metrics
        m.batch_tokens.observe(row)
        m.batch_requests.observe(len(jobs))
        m.tokens.inc(row)
        m.compute_seconds.observe((computed - started) / 1e9)
        m.encode_seconds.observe((time.perf_counter_ns() - computed) / 1e9)
        out_row_bytes = 2 * self.runner.hidden
        for job, ready in zip(jobs, done, strict=True):
            m.queue_seconds.observe((started - job.received_ns) / 1e9)
            if ready:
                a = job.args
                m.request_seconds.observe((ready - job.received_ns) / 1e9)
                m.request_bytes.observe(a.x.nbytes + a.ids.nbytes + a.weights.nbytes)
                m.response_bytes.observe(job.tokens * out_row_bytes)
        if tracing.active():
            _record_spans(jobs, done, started, computed, stage)
        return results


def _record_spans(jobs: list[Job], done: list[int], started: int, computed: int, stage: int):
    """Each answered request's server spans, from the times measured above: request
    (received -> answer ready; a child of the caller's span when it sent one), and
    within it queue, forward (the merged batch) and encode."""
    batch = {
        "expertd.batch_requests": len(jobs),
        "expertd.batch_tokens": sum(j.tokens for j in jobs),
        "expertd.stage_us": stage // 1000,
    }
    for job, ready in zip(jobs, done, strict=True):
        if not ready:
            continue
        attrs = {"expertd.layer": job.args.layer, "expertd.tokens": job.tokens}
        if job.sink is not None:
            attrs["expertd.transport"] = "slot"
        parent = tracing.parent_context(job.traceparent)
        span = tracing.record("expertd.server.request", job.received_ns, ready, parent, attrs)
        tracing.record("expertd.server.queue", job.received_ns, started, span)
        tracing.record("expertd.server.forward", started, computed, span, batch)
        tracing.record("expertd.server.encode", computed, ready, span)


def _settle(jobs: list[Job], results: list) -> None:
    """Hand each job its response bytes, or its error."""
    for job, result in zip(jobs, results, strict=True):
        if not job.future.done():
            if isinstance(result, Exception):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)


def _not_finite(args: ForwardArgs, out_bytes) -> tuple[RequestError, str]:
    """-> (the error, its cause "input" or "output"), naming the first non-finite
    input element, else the first token whose output is not finite (finite but
    huge inputs overflow). A rare path: host scans are fine."""
    for name, t in (("hidden_states", args.x), ("topk_weights", args.weights)):
        mask = ~torch.isfinite(t)
        if bool(mask.any()):
            r, c = (int(v) for v in mask.nonzero()[0])
            return invalid(
                f"{name}[{r}, {c}] is {float(t[r, c])}: NaN/Inf inputs are refused"
            ), "input"
    bits = np.ascontiguousarray(out_bytes).view(np.uint16)  # bf16: exponent all ones
    rows = np.flatnonzero(((bits & 0x7F80) == 0x7F80).any(axis=1))
    token = int(rows[0]) if rows.size else 0
    return invalid(
        f"output overflowed bf16 at token {token}: its hidden_states or topk_weights "
        "are too large (finite inputs, but the result is not)"
    ), "output"
