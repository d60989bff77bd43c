"""Layer calls queued on the caller's CUDA stream (`ExpertClient(..., on_stream=True)`).

A CUDA caller's call over cuda-ipc slots normally needs its host: the routes are
copied to the host and checked there (a wait for the caller's stream), the doorbell
is a host store, and the host waits for the answer. On a decode loop that keeps the
frontend's CPU from running ahead of its GPU, and each call pays that round trip.

Here the whole call is work on the caller's current stream, and `forward` returns
as soon as it is queued, like any torch op. No routing on the host: every shard of
the layer (they own each expert once) gets every token and all of its routes, and
computes the routes to its own experts. Per shard's slot:

    copy x into the slot's device x region                   (device to device)
    copy ids (as int32) and weights (as fp32) into the slot's routes regions
                                                              (device to host, DMA into the
                                                              page-locked control slot)
    write req_seq = seq                                       (cuStreamWriteValue32 on the
                                                              control block, mapped for the GPU)
then per slot sem_post(its semaphore)                         (a host function: wakes a
                                                              sleeping shard waiter)
then per slot wait until done_seq == seq                      (cuStreamWaitValue32)
then the answer: one shard's rows copied out, or several summed in shard order in
float32 (the host sum's order), then bf16.

The shard sees the doorbell as any other (its waiter spins or sleeps on the
semaphore), checks the call, runs it and answers as always; the call's flag
(FLAG_STREAM) makes its own stream store done_seq once the rows are in the out
region, so the caller's stream goes on without waiting for the shard's host to see
the batch finish (the shard's host stores done_seq too, with every answer: a call
refused before it ran releases the caller's stream the same way). Nothing in the
call waits on the caller's host.

What the host still does: a slot is handed to one call at a time. A `Tracker`
thread watches each queued call: once the shard has answered and the caller's
stream has copied the answer out, it checks the answer's status and gives the slot
back. Errors therefore arrive late, as a CUDA error does: the next `forward` (or
`synchronize`) raises the first failed call's ShardCallError, naming the shard, the
layer and the status. A call whose shard does not answer within its deadline, or
whose lease ends (the shard died), is failed by the tracker: it stores done_seq
itself, so the caller's stream is not left waiting forever, and drops the lease
(the next calls lease new slots, or use gRPC). The answer rows of a failed call are
whatever the slot held: read them only after `synchronize` has returned.

Where this path does not apply (shards that overlap in experts, a shard without
cuda-ipc slots or too old for the semaphore, tracing on, a CPU caller), `forward`
runs the call the usual way.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import grpc
import torch

from expertd import cudamem
from expertd import dataplane as dp
from expertd.client.cudaipc import CudaIpcSlot
from expertd.client.errors import ShardCallError
from expertd.client.shm import _CODES, EOF_CHECK_S

log = logging.getLogger("expertd.client")

_SEM_POST: int | None = None


def _sem_post() -> int:
    global _SEM_POST
    if _SEM_POST is None:
        _SEM_POST = dp.sem_post_address()
    return _SEM_POST


def usable(slots: list[CudaIpcSlot], m: int, k: int) -> bool:
    """Whether every slot can take an (m, k) call from a stream: False, with nothing
    queued, when one cannot be mapped for the GPU (it is not offered for that again).
    ValueError, with nothing queued, for a call that does not fit a slot."""
    for slot in slots:
        slot.layout.check(m, k)
    for slot in slots:
        try:
            slot.stream_words()
        except cudamem.CudaIpcError as e:
            log.warning("on-stream calls unavailable on a cuda-ipc slot: %s", e)
            slot.sem = 0  # stream_slots skips it from now on
            return False
    return True


def enqueue(
    slots: list[CudaIpcSlot], layer: int, x, ids, w, timeout: float, graph: bool = False
) -> torch.Tensor:
    """Queue one call to each slot (one per shard, `usable` checked) on the caller's
    current stream of x's device, then the sum of their answers -> bf16 [M, H], complete
    once the stream gets there. x: bf16 [M, H] on the slots' GPU; ids, w: [M, k] on the
    GPU (any integer / float dtype). Every shard gets every token and all of its routes
    and computes the routes to its own experts (the others are no work for it); the
    answers are summed in shard order in float32, as the split path's sum does.

    `graph`: the stream is capturing a CUDA graph and the slots are kept for it
    (`GraphCalls`): every value the stream stores is the same on each replay (see
    `_ring`), and no event marks the call (no host tracks it)."""
    stream = torch.cuda.current_stream(x.device)
    for slot in slots:  # every shard's rows and doorbell first: they compute side by side
        _ring(slot, stream, layer, x, ids, w, timeout, graph)
    if slots[0].sem:  # then the wake-ups of waiters asleep (a spinning one saw its word)
        for slot in slots:
            cudamem.host_call(stream, _sem_post(), slot.sem)
    for slot in slots:
        cudamem.wait_value(stream, slot.stream_words()[1], slot.seq, cudamem.WAIT_EQ)
    m, h = x.shape[0], slots[0].layout.hidden
    if len(slots) == 1 or not m:
        out = torch.empty((m, h), dtype=torch.bfloat16, device=x.device)
        if m:
            cudamem.copy_into(stream, out, slots[0].out_dev[:m])
    else:
        acc = slots[0].out_dev[:m].float()
        for slot in slots[1:]:
            acc.add_(slot.out_dev[:m])
        out = acc.to(torch.bfloat16)
    if not graph:
        for slot in slots:
            slot.done.record(stream)
    return out


def _ring(
    slot: CudaIpcSlot, stream, layer: int, x, ids, w, timeout: float, graph: bool = False
) -> None:
    """One slot's part of a call: the header, the rows, the doorbell.

    `graph` (a call captured in a CUDA graph): the header is stored once, now (the slot
    serves this one captured call for good); each replay stores done_seq = 0, the rows,
    then req_seq = GRAPH_SEQ, and waits for done_seq == GRAPH_SEQ (the shard sets
    req_seq back to 0 as it takes the call: FLAG_GRAPH). The rows' routes go through
    the slot's GPU mapping of the host slot (a graph's copies write it as kernels do)."""
    m, k = ids.shape
    req_dev, done_dev = slot.stream_words()
    ctl = slot.ctl
    # the slot is idle: req_seq is its last call's
    seq = dp.GRAPH_SEQ if graph else (ctl.req_seq + 1) & 0xFFFFFFFF
    ctl.layer = layer
    ctl.m = m
    ctl.k = k
    ctl.flags = dp.FLAG_STREAM | (dp.FLAG_GRAPH if graph else 0)
    ctl.timeout_us = max(int(timeout * 1e6), 1)
    ctl.span_id = 0
    slot.seq = seq
    slot.rows = m
    if graph:
        cudamem.write_value(stream, done_dev, 0)
        ids_dst, w_dst = slot.ids_mapped, slot.w_mapped
    else:
        ctl.seen_ns = 0
        slot.ring_ns = time.monotonic_ns()
        if slot.reading:  # a sum on another stream may still read the out region
            stream.wait_event(slot.read_done)
            slot.reading = False
        ids_dst, w_dst = slot.ids_host, slot.w_host
    if m:
        cudamem.copy_into(stream, slot.x_dev[:m], x)
        cudamem.copy_into(stream, ids_dst[: m * k].view(m, k), ids)
        cudamem.copy_into(stream, w_dst[: m * k].view(m, k), w)
    cudamem.write_value(stream, req_dev, seq)  # after a fence: the rows first


class _Call:
    __slots__ = ("deadline", "ep", "experts", "layer", "slot")

    def __init__(self, slot, deadline: float, ep, layer: int, experts) -> None:
        self.slot = slot
        self.deadline = deadline
        self.ep = ep  # the replica (client/replicas.Endpoint): its last_timing is set here
        self.layer = layer
        self.experts = experts


class Tracker:
    """The calls queued on callers' streams and not yet finished (see the module's
    docstring), and the errors they ended with, oldest first."""

    def __init__(self) -> None:
        self._calls: collections.deque[_Call] = collections.deque()
        self._cond = threading.Condition()
        self._errors: list[ShardCallError] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._calls)

    def add(self, slot, deadline: float, ep, layer: int, experts) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="expertd-on-stream", daemon=True
                )
                self._thread.start()
            self._calls.append(_Call(slot, deadline, ep, layer, experts))
            self._cond.notify_all()

    def wait_one(self) -> bool:
        """Wait until the oldest queued call is finished (its slot given back); False
        when none is queued."""
        with self._cond:
            if not self._calls:
                return False
            oldest = self._calls[0]
            while self._calls and self._calls[0] is oldest:
                self._cond.wait()
            return True

    def raise_error(self) -> None:
        """Raise the first failed call's error (and forget it), if any."""
        with self._cond:
            if self._errors:
                raise self._errors.pop(0)

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait until every queued call is finished (its deadline bounds that), then
        raise the first error, if any."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._calls:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{len(self._calls)} queued call(s) still running")
                self._cond.wait(left)
        self.raise_error()

    def close(self) -> None:
        """Finish what is queued (each call within its deadline), then stop."""
        with self._cond:
            while self._calls:
                self._cond.wait()
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._calls and not self._closed:
                    self._cond.wait()
                if not self._calls:
                    return
                call = self._calls[0]
            try:
                self._finish(call)
            except Exception as e:  # never leave a caller's stream waiting
                log.exception("on-stream call tracking failed")
                self._fail(call, grpc.StatusCode.INTERNAL, f"client: {e}")
            with self._cond:
                self._calls.popleft()
                self._cond.notify_all()

    def _finish(self, call: _Call) -> None:
        slot = call.slot
        ctl = slot.ctl
        old = (slot.seq - 1) & 0xFFFFFFFF
        while ctl.resp_seq != slot.seq:
            now = time.monotonic()
            if slot.lease.check_closed():
                why = slot.lease.why or "lease ended"
                self._fail(call, grpc.StatusCode.UNAVAILABLE, f"shard's slot lease ended: {why}")
                return
            if now >= call.deadline:
                self._fail(call, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed")
                return
            until = min(call.deadline, now + EOF_CHECK_S)
            if dp.wait_word(ctl, "resp_seq", slot.resp_addr, old, until, 0.0):
                old = ctl.resp_seq
        _stream_done(slot)  # the caller's stream has copied the answer out
        try:
            slot.checked_rows()
        except Exception as e:  # the shard's status, or a row count that is not the call's
            code = e.code() if hasattr(e, "code") else grpc.StatusCode.INTERNAL
            details = e.details() if hasattr(e, "details") else str(e)
            self._record(call, code, details)
        else:
            call.ep.last_timing = slot.timing()
        slot.release()

    def _fail(self, call: _Call, code, details: str) -> None:
        """The shard will not answer in time: let the caller's stream go on (done_seq
        stored here), record the error, and drop the lease: the slot may still be
        answered later, so it is never used again."""
        slot = call.slot
        if slot.ctl is not None:
            slot.ctl.done_seq = slot.seq
            _stream_done(slot)
        self._record(call, code, details)
        slot.lease._ended(f"an on-stream call failed: {details}")  # the loop closes it
        slot.release()  # unmapped: its lease has ended

    def _record(self, call: _Call, code, details: str) -> None:
        err = ShardCallError(call.ep.address, call.layer, call.experts, code, details)
        log.warning("on-stream call failed: %s", err)
        with self._cond:
            self._errors.append(err)


def _stream_done(slot) -> None:
    """Wait for the event after the call's copy out (a slot rung by its host, with no
    stream behind the call, has none)."""
    done = getattr(slot, "done", None)
    if done is not None:
        done.synchronize()


# How often the host looks at the slots of captured calls (a shard's end or a deadline
# is seen within this; so is a graph's error before `synchronize` looks itself).
GRAPH_WATCH_S = 0.01
GRAPH_SETTLE_S = 50e-6  # how often `settle` looks again


class _GraphCall:
    __slots__ = ("answered", "ep", "errors", "experts", "layer", "since", "slot", "timeout")

    def __init__(self, slot, ep, layer: int, experts, timeout: float) -> None:
        self.slot, self.ep, self.layer, self.experts = slot, ep, layer, experts
        self.timeout = timeout
        self.errors = slot.ctl.graph_errors
        self.answered = slot.ctl.answered_ns
        self.since: float | None = None  # when the call was first seen in flight


class GraphCalls:
    """The calls captured in CUDA graphs (`ExpertClient(..., on_stream=True,
    graph_slots=N)`), each keeping one slot per shard for good, and the host's watch over
    them, since no host waits for a replayed call: a thread looks at every such slot
    every GRAPH_WATCH_S and

    - records each error the shard answered a replay with (its status and text; the
      replay's rows hold no answer), raised by the next `forward` or `synchronize`;
    - releases a replay's stream whose shard is gone (its lease ended: UNAVAILABLE) or
      has not answered within the call's timeout (DEADLINE_EXCEEDED; its lease is ended
      too) by storing done_seq itself, so the caller's graph is never left waiting.

    The slots stay mapped until the client closes: close it only once its graphs are
    no longer replayed."""

    def __init__(self) -> None:
        self._calls: list[_GraphCall] = []
        self._errors: list[ShardCallError] = []
        self._lock = threading.Lock()
        self._checking = threading.Lock()  # the watch thread and `synchronize` alike
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, slot, ep, layer: int, experts, timeout: float) -> None:
        with self._lock:
            self._calls.append(_GraphCall(slot, ep, layer, experts, timeout))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="expertd-graphs", daemon=True
                )
                self._thread.start()

    def check(self) -> None:
        """Look at every captured call's slot now (see the class)."""
        with self._checking:
            self._check()

    def _check(self) -> None:
        now = time.monotonic()
        with self._lock:
            calls = list(self._calls)
        for call in calls:
            ctl = call.slot.ctl
            if ctl is None:
                continue
            errors = ctl.graph_errors
            if errors != call.errors:
                call.errors = errors
                code = _CODES.get(ctl.graph_status, grpc.StatusCode.UNKNOWN)
                self._record(call, code, call.slot.error_text() or code.name)
            answered = ctl.answered_ns
            if answered != call.answered:  # answered since the last look: not stuck
                call.answered = answered
                call.since = None
                call.ep.last_timing = {name: getattr(ctl, name) for name in dp.TIMING_FIELDS}
            if ctl.done_seq != 0:  # no replay waiting on this slot
                call.since = None
                continue
            if call.since is None:  # a replay waits: since when (as far as looks tell)
                call.since = now
            elif call.slot.lease.check_closed():
                why = call.slot.lease.why or "lease ended"
                self._release(call, grpc.StatusCode.UNAVAILABLE, f"shard's slot lease ended: {why}")
            elif now - call.since > call.timeout:
                self._release(call, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed")
                call.slot.lease._ended("a call captured in a graph passed its deadline")

    def _release(self, call: _GraphCall, code, details: str) -> None:
        # the error first: a caller whose stream goes on once done_seq is stored and
        # then asks (synchronize) must find it
        self._record(call, code, details)
        call.since = None
        call.slot.ctl.done_seq = dp.GRAPH_SEQ  # the replay's stream goes on

    def _record(self, call: _GraphCall, code, details: str) -> None:
        err = ShardCallError(call.ep.address, call.layer, call.experts, code, details)
        log.warning("a call captured in a CUDA graph failed: %s", err)
        with self._lock:
            self._errors.append(err)

    def raise_error(self) -> None:
        with self._lock:
            if self._errors:
                raise self._errors.pop(0)

    def settle(self, timeout: float) -> None:
        """Once the caller's stream has been synchronized: wait (at most `timeout`) until
        the shards' hosts have finished every replay they took. A shard's stream
        releases a replay as soon as its rows are in place; its host then looks at the
        rows (NaN/Inf) and may still answer with an error, which `check` must see."""
        end = time.monotonic() + timeout
        with self._lock:
            slots = [call.slot for call in self._calls]
        for slot in slots:
            while time.monotonic() < end:
                ctl = slot.ctl
                if ctl is None or slot.lease.closed:
                    break
                if ctl.req_seq == 0 and ctl.answered_ns >= ctl.seen_ns:  # taken, answered
                    break
                if ctl.done_seq == 0:  # a replay still waits: not the caller's synchronize
                    break
                time.sleep(GRAPH_SETTLE_S)

    def _run(self) -> None:
        while not self._stop.wait(GRAPH_WATCH_S):
            try:
                self.check()
            except Exception:
                log.exception("watching the calls captured in CUDA graphs failed")

    def close(self) -> None:
        """Stop watching and give the slots up (unmapped as their leases close)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            calls, self._calls = self._calls, []
        for call in calls:
            call.slot.held = False
