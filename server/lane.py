"""The lane: a cuda-ipc slot's call, run to its answer by the slot's own thread.

A small call on a GPU shard is mostly host time: the GPU part of M = 1 is a few tens of
microseconds, and the general path around it (the checks as tensors, a Job, the batcher's
start and finish, the runner's views and flights, a result object, torch's stream and
event calls) costs more than that on the shard's host alone (docs/dataplane.md). When
the batcher is idle, a cuda-ipc slot's call whose (layer, bucket) has a lane graph
(server/graphs.py: every captured bucket, up to 1024 tokens) takes the lane instead: its
waiter thread makes one C call (kernels/csrc/graph_call.cu, without the interpreter's
lock) that

1. copies the call's ids and weights from the slot into the lane block
   (mapped host memory), padded to the bucket with "no route", checks the copy (ids in
   [-1, E)) and writes the call's header there: m, where x lies, where the rows go;
2. launches the bucket's lane graph on the runner's compute stream (the block copied to
   the GPU, x and the routes in, the forward, the rows out into the slot's device out
   region and their NaN/Inf flags into the block), queues the client's stream bell (an
   on-stream call, a captured one included) and an event, and waits for the event;

and then answers: status, timing and resp_seq into the slot, as the batcher's finisher
does.

The forward is the graph's, on the same buffers as a batch of this call alone: the same
bits. Anything else takes the general path: an id out of range or a non-finite row (its
error comes from there, with its message), tracing on, a batch in flight or queued, a
call larger than the largest bucket or of a layer without graphs.
`expertd serve --lane off` sends every call the general way.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from expertd.cudamem import Calls, make_current
from expertd.kernels.cuda import (
    GRAPH_CALL_BAD_ID,
    GRAPH_CALL_FAILED,
    GRAPH_CALL_NONFINITE,
    GraphCallPlan,
    graph_call_fn,
)

log = logging.getLogger("expertd.server")


class _Plan:
    """Where a call of one bucket leaves its routes and finds its flags (the lane's
    runner slot, LANE_SLOT, is the only one with lane graphs)."""

    __slots__ = ("c", "exec_by_layer")

    def __init__(self, lane: Lane, bucket: int) -> None:
        block = lane.graphs.block
        shape, addr, calls = block.shape, block.addr, lane.calls
        self.c = GraphCallPlan(
            header=addr,
            ids_host=addr + shape.ids_offset,
            weights_host=addr + shape.weights_offset(bucket),
            flags_host=addr + shape.flags_offset,
            rows=bucket,
            top_k=shape.top_k,
            num_experts=lane.num_experts,
            stream=lane.stream,
            event=lane.event,
            launch=calls.launch,
            write=calls.write,
            record=calls.record,
            sync=calls.sync,
        )
        self.exec_by_layer: dict[int, int | None] = {}


class Lane:
    def __init__(self, servicer, runner, batcher, num_experts: int) -> None:
        self.servicer = servicer
        self.runner = runner
        self.graphs = runner.graphs
        self.batcher = batcher
        self.num_experts = num_experts
        self.row_bytes = 2 * runner.hidden
        if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
            raise RuntimeError(f"torch {torch.__version__} does not hand out a graph's exec")
        self.call = graph_call_fn()  # AttributeError: a kernel library older than the lane
        self.calls = Calls()
        self.stream = runner.compute_stream.cuda_stream
        make_current(runner.device)  # the driver's calls need the context current here
        self.event = self.calls.event()
        self._plans: dict[int, _Plan] = {}  # by bucket
        self._threads = threading.local()  # .ready: the device's context is current here
        self._said: set[str] = set()  # why calls took the general path, logged once each

    def _decline(self, why: str) -> bool:
        if why not in self._said:
            self._said.add(why)
            log.info("a slot call took the general path (said once): %s", why)
        return False

    @classmethod
    def for_runner(cls, servicer, runner, batcher, num_experts: int) -> Lane | None:
        """A lane for this runner, or None where it has no captured graphs (CPU, eager)
        or the driver's calls or the kernel library's are missing (logged)."""
        if runner.graphs is None or runner.device.type != "cuda":
            return None
        if runner.graphs.block is None:
            log.warning("slot calls take the general path: no lane graphs (H % 8, library)")
            return None
        try:
            lane = cls(servicer, runner, batcher, num_experts)
        except Exception as e:  # the driver's entry points, an old kernel library
            log.warning("small slot calls take the general path: %s", e)
            return None
        log.info("cuda-ipc slot calls take the lane (up to %d tokens)", runner.graphs.buckets[-1])
        return lane

    def run(self, slot, layer: int, m: int, k: int, timeout_us: int, received: int) -> bool:
        """Run a checked cuda-ipc slot call (m >= 1, k within the slot's top_k) to its
        answer -> True; False: nothing answered, the call takes the general path."""
        graphs = self.graphs
        bucket = graphs.bucket(layer, m, k)
        if bucket is None:
            return self._decline(f"no graph for layer {layer}, {m} tokens, top-k {k}")
        ids, weights, x, out = slot.lane_addresses
        if (x | out) & 15:
            return self._decline("the slot's rows are not 16-byte aligned")
        if not getattr(self._threads, "ready", False):  # the driver calls need the context
            make_current(self.runner.device)
            self._threads.ready = True
        index = self.batcher.take_lone()
        if index is None:
            return False  # a batch in flight or queued: it batches with them
        try:
            started = time.perf_counter_ns()
            if timeout_us and started - received >= timeout_us * 1000:
                return self._decline("deadline passed")  # the general path says so
            plan = self._plans.get(bucket)
            if plan is None:
                plan = self._plans[bucket] = _Plan(self, bucket)
            if layer not in plan.exec_by_layer:
                plan.exec_by_layer[layer] = graphs.lane_exec(layer, bucket)
            graph = plan.exec_by_layer[layer]
            if graph is None:
                return self._decline(f"no lane graph for layer {layer}, bucket {bucket}")
            bell_addr, bell_value = slot.stream_bell() or (0, 0)
            rc = self.call(plan.c, graph, m, k, ids, weights, x, out, bell_addr, bell_value)
            computed = time.perf_counter_ns()
            if rc == GRAPH_CALL_BAD_ID:
                slot.bell_queued = False  # nothing was queued: the general path answers
                return self._decline("an id out of range")  # the general path names it
            if rc == GRAPH_CALL_NONFINITE:
                return self._decline("NaN/Inf")  # the general path runs it again, names it
            if rc == GRAPH_CALL_FAILED:
                slot.bell_queued = False  # the host's answer releases a waiting stream
                raise RuntimeError(plan.c.error.decode(errors="replace"))
        finally:
            self.batcher.give_lone(index)
        timing = {
            "queue_us": (started - received) // 1000,
            "compute_us": (computed - started) // 1000,
            "total_us": (time.perf_counter_ns() - received) // 1000,
            "stage_us": 0,
            "device_us": (computed - started) // 1000,
            "batch_requests": 1,
            "batch_tokens": m,
        }
        slot.write_placed(m, timing)
        nbytes = m * self.row_bytes
        self.servicer.count_slot_ok(
            m, started - received, computed - started, nbytes + 8 * m * k, nbytes
        )
        return True
