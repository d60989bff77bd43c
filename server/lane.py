"""The lane: a small call of a cuda-ipc slot, run to its answer by the slot's own thread.

A small call on a GPU shard is mostly host time: the GPU part of M = 1 is a few tens of
microseconds, and the general path around it (the checks as tensors, a Job, the batcher's
start and finish, the runner's views and flights, a result object, torch's stream and
event calls) costs more than that on the shard's host alone (docs/dataplane.md). When
the batcher is idle, a cuda-ipc slot's call of up to FUSED_ROWS tokens whose layer has a
captured graph takes the lane instead: its waiter thread

1. copies the call's ids and weights from the slot into the runner slot's page-locked
   routes buffer (padding to the bucket as `HostStaging.pack` does) and checks the copy
   (ids in [-1, E));
2. queues, on the runner's compute stream, one driver call each: the routes up, x from
   the slot's device region into the graph's input, the bucket's graph without host
   copies, the rows into the slot's device out region, the rows' NaN/Inf flags down, the
   client's stream bell (an on-stream call), and an event; then waits for the event;
3. answers: status, timing and resp_seq into the slot, as the batcher's finisher does.

The same graph, buffers and copies as `BatchRunner._enqueue_device` with one batch
alone: the same bits. Anything else takes the general path: an id out of range or a
non-finite row (its error comes from there, with its message), tracing on, a batch in
flight or queued, a call larger than the fused buckets or of a layer without graphs. A call
captured in the client's CUDA graph takes the lane as any on-stream call does: its
routes reach the slot through the client's stream before its bell.
`expertd serve --lane off` sends every call the general way.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from expertd.cudamem import Calls, make_current
from expertd.server.runner import FUSED_ROWS

log = logging.getLogger("expertd.server")


class _Plan:
    """What a call of one (client slot, runner slot, bucket) copies where: addresses and
    sizes fixed for the life of the lease's slot, and numpy views of the host buffers."""

    __slots__ = (
        "exec_by_layer",
        "flags_dev",
        "flags_host",
        "host",
        "layout",
        "out_dev",
        "routes_bytes",
        "routes_dev",
        "routes_host",
        "x_dev",
    )

    def __init__(self, runner, graphs, index: int, bucket: int) -> None:
        self.layout = layout = graphs.layouts[bucket]
        self.host = runner.slot_host(index)  # the runner slot's page-locked buffers
        dev_in, dev_out = graphs.buffers(index)
        self.routes_dev = dev_in.data_ptr()
        self.routes_bytes = layout.x_offset  # ids and weights of every row of the bucket
        self.routes_host = self.host.input.data_ptr()
        self.x_dev = dev_in.data_ptr() + layout.x_offset
        self.out_dev = dev_out.data_ptr() + layout.out_offset
        self.flags_dev = dev_out.data_ptr()
        self.flags_host = self.host.output.numpy()[: layout.rows].view(np.bool_)
        self.exec_by_layer: dict[int, int] = {}

    def current(self) -> bool:
        """Whether the runner slot's host buffers are still the ones planned for (an
        eager batch may have grown them since)."""
        host = self.host
        return (
            self.routes_host == host.input.data_ptr()
            and self.flags_host.ctypes.data == host.output.data_ptr()
        )


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
        self.calls = Calls()
        self.stream = runner.compute_stream.cuda_stream
        make_current(runner.device)  # the driver's calls need the context current here
        self._events = [self.calls.event() for _ in range(runner.depth)]
        self._plans: dict[tuple[int, int], _Plan] = {}
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
        or the driver's calls are missing (logged)."""
        if runner.graphs is None or runner.device.type != "cuda":
            return None
        try:
            lane = cls(servicer, runner, batcher, num_experts)
        except Exception as e:  # the driver's entry points, most likely
            log.warning("small slot calls take the general path: %s", e)
            return None
        log.info("small cuda-ipc slot calls take the lane (up to %d tokens)", FUSED_ROWS)
        return lane

    def run(self, slot, layer: int, m: int, k: int, timeout_us: int, received: int) -> bool:
        """Run a checked cuda-ipc slot call (m >= 1, k within the slot's top_k) to its
        answer -> True; False: nothing answered, the call takes the general path."""
        if m > FUSED_ROWS:
            return self._decline(f"more than {FUSED_ROWS} tokens")
        graphs = self.graphs
        bucket = graphs.bucket(layer, m, k)
        if bucket is None:
            return self._decline(f"no graph for layer {layer}, {m} tokens, top-k {k}")
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
            plan = self._plans.get((index, bucket))
            if plan is None or not plan.current():
                plan = self._plans[(index, bucket)] = _Plan(self.runner, graphs, index, bucket)
            graph = plan.exec_by_layer.get(layer)
            if graph is None:
                graph = plan.exec_by_layer[layer] = graphs.exec_handle(layer, bucket, index)
            n = m * k
            ids = plan.host.pack_routes(
                plan.layout, slot.ids_region(n).reshape(m, k), slot.weights_region(n).reshape(m, k)
            )
            if ids.min() < -1 or ids.max() >= self.num_experts:
                return self._decline("an id out of range")  # the general path names it
            nbytes = m * self.row_bytes
            bell = slot.stream_bell()
            calls, stream, event = self.calls, self.stream, self._events[index]
            calls.copy(stream, plan.routes_dev, plan.routes_host, plan.routes_bytes)
            calls.copy(stream, plan.x_dev, slot.x_device_ptr, nbytes)
            calls.launch(stream, graph)
            calls.copy(stream, slot.out_device_ptr, plan.out_dev, nbytes)
            calls.copy(stream, plan.flags_host.ctypes.data, plan.flags_dev, m)
            if bell is not None:
                calls.write(stream, *bell)
            calls.record(stream, event)
            calls.synchronize(event)
            computed = time.perf_counter_ns()
            if plan.flags_host[:m].any():
                return self._decline("NaN/Inf")  # the general path runs it again, names it
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
        self.servicer.count_slot_ok(
            m, started - received, computed - started, nbytes + 8 * n, nbytes
        )
        return True
