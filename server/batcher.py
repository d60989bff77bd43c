"""Cross-request batching: concurrent requests for the same layer (from any
number of frontends) become one forward, so each expert's weights are read once
for all of them.

One asyncio task owns the queue. It takes the oldest request, optionally waits
up to `window_s` (counted from that request's arrival) for more of the same
layer, takes that layer's queued requests in arrival order up to
`max_batch_tokens`, and runs them on the compute thread; requests for other
layers keep their place. With `window_s = 0` nothing waits: requests that
arrived while the device was busy are merged, which costs no latency.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass, field

import grpc
import torch

from expertd.codec import encode_forward_response
from expertd.server.metrics import Metrics
from expertd.server.runner import BatchRunner
from expertd.server.validate import ForwardArgs, RequestError, invalid
from expertd.v1 import expertd_pb2 as pb


@dataclass(slots=True)
class Job:
    args: ForwardArgs
    deadline: float | None  # time.monotonic() value, or None
    received_ns: int  # time.perf_counter_ns() at arrival
    future: asyncio.Future
    request_id: int = 0  # echoed in the response
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
        self.computing = 0  # tokens of the batch on the compute thread now

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for job in self._queue:
            if not job.future.done():
                job.future.set_exception(
                    RequestError(grpc.StatusCode.UNAVAILABLE, "server stopped")
                )
        self._queue.clear()

    def submit(self, job: Job) -> None:
        """Queue a validated request, or refuse it when the queue is full."""
        p = self.policy
        if len(self._queue) >= p.max_queue_requests or (
            self._queue and self._queued_tokens + job.tokens > p.max_queue_tokens
        ):
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server queue full: {len(self._queue)} requests / {self._queued_tokens} tokens "
                f"waiting (limits {p.max_queue_requests} / {p.max_queue_tokens})",
            )
        self._queue.append(job)
        self._queued_tokens += job.tokens
        self.metrics.queued_tokens.set(self._queued_tokens)
        self._wake.set()

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
            if job.args.layer == layer and (not batch or fits):
                batch.append(job)
                tokens += job.tokens
            else:
                rest.append(job)
        self._queue = rest
        self._queued_tokens -= tokens
        self.metrics.queued_tokens.set(self._queued_tokens)
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
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
            if not live:
                continue
            self.computing = sum(j.tokens for j in live)
            try:
                results = await loop.run_in_executor(self.compute, self._compute, live)
            except Exception as e:  # a bug or a device fault: every caller of the batch hears it
                for job in live:
                    if not job.future.done():
                        job.future.set_exception(e)
                continue
            finally:
                self.computing = 0
            for job, result in zip(live, results, strict=True):
                if not job.future.done():
                    if isinstance(result, Exception):
                        job.future.set_exception(result)
                    else:
                        job.future.set_result(result)

    # -- on the compute thread --------------------------------------------------

    def _compute(self, jobs: list[Job]):
        """Merged forward, then one response (or error) per job."""
        started = time.perf_counter_ns()
        args = [j.args for j in jobs]
        out, bad = self.runner.run(
            args[0].layer, [a.x for a in args], [a.ids for a in args], [a.weights for a in args]
        )
        computed = time.perf_counter_ns()
        stage = self.runner.stage_ns
        batch_tokens = sum(j.tokens for j in jobs)
        results, row = [], 0
        for job in jobs:
            rows = job.tokens
            if rows and bool(bad[row : row + rows].any()):
                results.append(_not_finite(job.args))
            else:
                timing = pb.Timing(
                    queue_us=(started - job.received_ns) // 1000,
                    compute_us=(computed - started) // 1000,
                    total_us=(time.perf_counter_ns() - job.received_ns) // 1000,
                    stage_us=stage // 1000,
                    device_us=(computed - started - stage) // 1000,
                    batch_requests=len(jobs),
                    batch_tokens=batch_tokens,
                )
                # The whole serialized response, its output copied once from the
                # (pinned, reused) output buffer: before the next batch runs.
                payload = out[row : row + rows].view(torch.uint8).numpy()
                shape = (rows, out.shape[1])
                results.append(
                    encode_forward_response(job.request_id, pb.BF16, shape, payload, timing)
                )
            row += rows
        m = self.metrics
        m.batch_tokens.observe(row)
        m.batch_requests.observe(len(jobs))
        m.tokens.inc(row)
        m.compute_seconds.observe((computed - started) / 1e9)
        m.encode_seconds.observe((time.perf_counter_ns() - computed) / 1e9)
        for job in jobs:
            m.queue_seconds.observe((started - job.received_ns) / 1e9)
        return results


def _not_finite(args: ForwardArgs) -> RequestError:
    """Name the first non-finite input element (rare path: a host scan is fine)."""
    for name, t in (("hidden_states", args.x), ("topk_weights", args.weights)):
        mask = ~torch.isfinite(t)
        if bool(mask.any()):
            r, c = (int(v) for v in mask.nonzero()[0])
            return invalid(f"{name}[{r}, {c}] is {float(t[r, c])}: NaN/Inf inputs are refused")
    return invalid("non-finite input")
