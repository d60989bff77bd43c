"""Running merged batches on the backend's device.

Several requests' host tensors go in; one bf16 [M, H] output and a per-row
"input or output was not finite" flag come out, on the host (`staging.Result`).

A batch runs in one of `depth` slots. `launch` gathers it and starts it,
`Flight.wait` returns its results, `Flight.release` hands the slot back once
they have been read; `run` does all three.

On CUDA each slot has a packed pinned host buffer and packed device buffers
per direction (server/graphs.py `Layout`): the requests are gathered into the
slot's pinned input with numpy (server/staging.py), ONE host-to-device copy on
the upload stream moves them, the compute stream replays the slot's CUDA graph
for the batch's bucket (or runs the forward eager), and ONE device-to-host copy
on the download stream brings back [bad flags | output]. Events order upload
-> compute -> download within a batch; the backend (and its workspace) only
ever runs on the compute stream. With depth 2, batch n+1 is gathered and
copied in while batch n computes, and batch n-1's results come back meanwhile.
The host waits for nothing but a batch's own download event, before its
results are read. The NaN/Inf check (of the inputs and of the output, which
finite but huge inputs overflow) runs on the device (inside the graph) and its
flags come back in the same copy as the output.

Batches of up to FUSED_ROWS tokens run a graph that holds the copies too
(server/graphs.py): gathered into the slot's fixed pinned buffers, they are one
replay on the compute stream and one event, a third of the host time of the
path above (the copies of a small batch take microseconds, so overlapping them
with other batches' compute is worth less than the Python calls it needs).

Other devices (CPU): `launch` gathers (a single request is used as received,
several with the same packing code), the forward runs in `wait`; one slot by
default, so batches run one at a time as before.
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch

from expertd.cudamem import copy_into, on_stream, write_value
from expertd.progress import Progress
from expertd.server.bank import ExpertBank
from expertd.server.graphs import (
    DEFAULT_BUCKETS,
    GraphBank,
    Layout,
    capturable,
    forward_checked,
    host_nonfinite_rows,
)
from expertd.server.staging import HostStaging, Result, SlotPool

log = logging.getLogger("expertd.server")

CUDA_DEPTH = 2  # batches in flight on a GPU: one computing, the next being copied in
LANE_SLOT = 0  # the pipeline slot a lane call runs in (Batcher.take_lone), with its graphs
FUSED_ROWS = 64  # graph buckets up to this many tokens copy in and out inside the graph


class _Slot:
    """One batch's worth of buffers (and, on CUDA, its events)."""

    def __init__(
        self,
        index: int,
        device: torch.device,
        in_bytes: int,
        out_bytes: int,
        fused_bytes: tuple[int, int] = (0, 0),
    ) -> None:
        cuda = device.type == "cuda"
        self.index = index
        self.host = HostStaging(pin=cuda, in_bytes=in_bytes, out_bytes=out_bytes)
        # The fused buckets' graphs copy from and to these: never reallocated.
        self.graph_host = (
            HostStaging(pin=True, in_bytes=fused_bytes[0], out_bytes=fused_bytes[1], fixed=True)
            if fused_bytes[0]
            else None
        )
        # Device buffers of eager batches (larger than any graph bucket), grown on demand;
        # graphed batches use the GraphBank's fixed buffers of this slot.
        self.dev_in: torch.Tensor | None = None
        self.dev_out: torch.Tensor | None = None
        self.uploaded = torch.cuda.Event() if cuda else None
        self.computed = torch.cuda.Event() if cuda else None
        self.downloaded = torch.cuda.Event() if cuda else None

    def eager_buffers(self, layout: Layout, device: torch.device):
        """Device buffers for an eager batch. Only grown while the slot is free, so
        no queued work still uses the old ones."""
        if self.dev_in is None or self.dev_in.numel() < layout.in_bytes:
            self.dev_in = torch.empty(layout.in_bytes, dtype=torch.uint8, device=device)
        if self.dev_out is None or self.dev_out.numel() < layout.out_bytes:
            self.dev_out = torch.empty(layout.out_bytes, dtype=torch.uint8, device=device)
        return self.dev_in, self.dev_out


class Flight:
    """A launched batch: `wait()` for its results, then `release()` its slot once
    they have been read (its result arrays may be views of the slot's buffers)."""

    __slots__ = (
        "_host",
        "_result",
        "_runner",
        "_slot",
        "layout",
        "m",
        "placed",
        "stage_ns",
        "staging",
    )

    def __init__(
        self,
        runner,
        slot: _Slot,
        layout: Layout | None,
        m: int,
        stage_ns: int,
        staging: HostStaging | None = None,
        placed: bool = False,
    ) -> None:
        self._runner = runner
        self._slot: _Slot | None = slot
        self.layout = layout  # on CUDA: the layout of the slot's buffers this batch uses
        self.staging = staging  # on CUDA: the slot's host buffers this batch uses
        self.m = m
        self.placed = placed  # the output rows went into the requests' `outs` directly
        self.stage_ns = stage_ns  # host time spent gathering the requests
        self._result: Result | None = None
        self._host: tuple | None = None  # off the GPU: (state, x, ids, w) for `wait` to run

    @property
    def done(self) -> bool:
        """The results are on the host already (nothing to wait for or compute)."""
        return self._result is not None

    def wait(self) -> Result:
        """The results: on CUDA after waiting for the batch's download event only;
        off the GPU the forward runs here."""
        if self._result is None:
            if self._slot is None:
                raise RuntimeError("batch released before its results were read")
            self._result = self._runner._collect(self)
        return self._result

    def release(self) -> None:
        if self._slot is not None:
            slot, self._slot = self._slot, None
            self._host = None
            self._runner._slots.release(slot.index)


class _DeviceViews:
    """The views a device batch of one slot and layout copies through: the routes'
    prefix of the host and device input buffers, x and out on the device, the flags
    on the device and in the host output buffer. Kept per (slot, bucket) for the
    graphs' fixed buffers, since a small call is mostly host time and each view costs
    a few tensor constructions; rebuilt when an eager batch has grown the slot's host
    buffers since (`current`)."""

    __slots__ = (
        "dev_in",
        "dev_out",
        "flags_dev",
        "flags_host",
        "host_in",
        "host_out",
        "out",
        "routes_dev",
        "routes_host",
        "x",
    )

    def __init__(self, layout: Layout, slot: _Slot, dev_in: torch.Tensor, dev_out: torch.Tensor):
        self.dev_in, self.dev_out = dev_in, dev_out
        self.x = layout.inputs(dev_in)[0]
        self.out = layout.outputs(dev_out)[0]
        routes, flags = layout.x_offset, layout.out_offset
        self.host_in, self.host_out = slot.host.input, slot.host.output
        self.routes_host, self.routes_dev = self.host_in[:routes], dev_in[:routes]
        self.flags_host, self.flags_dev = self.host_out[:flags], dev_out[:flags]

    def current(self, slot: _Slot) -> bool:
        """Whether the slot's host buffers are still the ones viewed."""
        return self.host_in is slot.host.input and self.host_out is slot.host.output


class BatchRunner:
    def __init__(
        self,
        bank: ExpertBank,
        graph_max_tokens: int = DEFAULT_BUCKETS[-1],
        depth: int | None = None,
        lane: bool = False,
    ) -> None:
        """`lane`: also capture the lane's graphs (server/lane.py) where the backend can."""
        self.bank = bank
        self.device = bank.backend.device
        self.hidden = bank.info.hidden_size
        cuda = self.device.type == "cuda"
        self.depth = depth if depth is not None else (CUDA_DEPTH if cuda else 1)
        if self.depth < 1:
            raise ValueError(f"pipeline depth must be at least 1 (got {self.depth})")
        self._slots = SlotPool(self.depth)
        self.graphs: GraphBank | None = None
        buckets = [b for b in DEFAULT_BUCKETS if b <= graph_max_tokens]
        if buckets and capturable(bank.backend):
            top_k = bank.info.top_k or 8
            self.graphs = GraphBank(
                bank.backend,
                self.hidden,
                top_k,
                buckets,
                slots=self.depth,
                fused_rows=FUSED_ROWS,
                lane_slot=LANE_SLOT if lane else None,
            )
        in_bytes = out_bytes = 0
        fused = (0, 0)
        if self.graphs is not None:  # pinned once, up front, for every bucket
            in_bytes = max(lay.in_bytes for lay in self.graphs.layouts.values())
            out_bytes = max(lay.out_bytes for lay in self.graphs.layouts.values())
            fused = self.graphs.fused_bytes()
        self._slot_bufs = [
            _Slot(i, self.device, in_bytes, out_bytes, fused) for i in range(self.depth)
        ]
        self._views: dict[tuple[int, int], _DeviceViews] = {}  # (slot, bucket) -> views
        if cuda:
            self._upload = torch.cuda.Stream(self.device)
            self._compute = torch.cuda.Stream(self.device)
            self._download = torch.cuda.Stream(self.device)

    @property
    def free_slots(self) -> int:
        """Slots not holding a batch now (any thread)."""
        return self._slots.free

    def take_slot(self, index: int) -> bool:
        """Slot `index` for a call its caller runs itself (server/lane.py: the slot's
        graph buffers and lane graphs), if it is free -> whether it was."""
        return self._slots.acquire_this(index)

    def give_slot(self, index: int) -> None:
        self._slots.release(index)

    @property
    def compute_stream(self) -> torch.cuda.Stream:
        """The stream every forward runs on (CUDA)."""
        return self._compute

    def warmup(self) -> None:
        """Before SERVING: capture the CUDA graphs (which also builds and loads the
        kernels), then run one tiny batch per layer and slot through the serving
        path, so that anything amiss shows before the first request."""
        start = time.perf_counter()
        x = torch.zeros((1, self.hidden), dtype=torch.bfloat16)
        no_route, weight = torch.full((1, 1), -1, dtype=torch.int32), torch.zeros((1, 1))
        layers = self.bank.info.layers
        what = "capturing CUDA graphs" if self.graphs is not None else "warming up"
        bar = Progress(what, len(layers), log=log)
        for n, layer in enumerate(layers, 1):
            if self.graphs is not None:
                hosts = None
                if self._slot_bufs[0].graph_host is not None:
                    hosts = [(s.graph_host.input, s.graph_host.output) for s in self._slot_bufs]
                self.graphs.capture(layer, self.bank.state(layer), hosts)
            for _ in range(self.depth):  # slots are handed out in turn
                self.run(layer, [x], [no_route], [weight])
            if self.graphs is not None:  # seconds per layer on a GPU; CPU: nothing to show
                bar.update(n, f"{what}: layer {layer}")
        bar.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info(
            "warm-up done in %.1f s%s",
            time.perf_counter() - start,
            f" ({len(self.bank.info.layers)} layers x buckets {self.graphs.buckets} x "
            f"{self.depth} slots captured)"
            if self.graphs
            else "",
        )

    def run(self, layer: int, xs, ids, ws) -> tuple[torch.Tensor, torch.Tensor]:
        """launch, wait, release -> (out bf16 [M, H], bad bool [M]: row had NaN/Inf
        input or output), on the host. On CUDA they are views of a slot's reused pinned
        buffer: read them before the next run."""
        flight = self.launch(layer, xs, ids, ws)
        try:
            result = flight.wait()
        finally:
            flight.release()
        return result.out, result.bad

    def launch(self, layer: int, xs, ids, ws, outs=None, bells=None) -> Flight:
        """Start one merged batch (requests' host tensors, in order) in a free slot.

        `outs` (CUDA only; cuda-ipc slots, page-locked shm slots): outs[i] (bf16
        [rows_i, H], on a device or in page-locked host memory) takes request i's
        output rows, and the requests' x (the same kinds of memory) are copied to the
        device as they are; the result then carries only the NaN/Inf flags, on the
        host. ids and weights are host tensors either way. `bells` (with `outs`):
        per request None or (the GPU address of a u32, a value) that the stream stores
        once the request's rows are in outs[i] (a call queued on its client's stream
        goes on from there).

        Refuses (RuntimeError) when all `depth` slots hold unreleased batches."""
        start = time.perf_counter_ns()
        state = self.bank.state(layer)
        slot = self._slot_bufs[self._slots.acquire()]
        queued = False
        try:
            m = sum(x.shape[0] for x in xs)
            k = max(i.shape[1] for i in ids)
            if self.device.type != "cuda":
                return self._run_on_host(slot, state, xs, ids, ws, m, k, start)
            bucket = self.graphs.bucket(layer, m, k) if self.graphs is not None else None
            layout = (
                self.graphs.layouts[bucket] if bucket is not None else Layout(m, k, self.hidden)
            )
            fused = bucket is not None and self.graphs.fused(bucket) and outs is None
            staging = slot.graph_host if fused else slot.host
            staging.pack(layout, xs, ids, ws, with_x=outs is None)
            flight = Flight(
                self, slot, layout, m, time.perf_counter_ns() - start, staging, outs is not None
            )
            if m == 0:
                flight._result = Result(
                    np.zeros((0, 2 * self.hidden), np.uint8), np.zeros(0, np.bool_)
                )
            else:
                queued = True
                if outs is not None:
                    alone = self._slots.free == self.depth - 1  # no other batch in flight
                    self._enqueue_device(
                        slot, layer, state, layout, bucket, m, xs, outs, alone, bells
                    )
                else:
                    self._enqueue(slot, layer, state, layout, bucket, m, fused)
            return flight
        except BaseException:
            if queued:  # part of this batch may be queued on the streams: let it end first
                with contextlib.suppress(RuntimeError):  # a device fault is raised already
                    torch.cuda.synchronize(self.device)
            self._slots.release(slot.index)
            raise

    def _run_on_host(self, slot: _Slot, state, xs, ids, ws, m: int, k: int, start: int) -> Flight:
        """Gather (a single request is used as received); the forward runs in `wait`."""
        if len(xs) == 1:
            x, i, w = xs[0], ids[0].to(torch.int32), ws[0].to(torch.float32)
        else:
            layout = Layout(m, k, self.hidden)
            slot.host.pack(layout, xs, ids, ws)
            x, i, w = layout.inputs(slot.host.input)
        flight = Flight(self, slot, None, m, time.perf_counter_ns() - start)
        flight._host = (state, x, i, w)
        return flight

    def _enqueue(
        self,
        slot: _Slot,
        layer: int,
        state,
        layout: Layout,
        bucket: int | None,
        m: int,
        fused: bool,
    ) -> None:
        """Queue one batch: copy in (upload stream), forward (compute stream), copy
        out (download stream), each stage waiting on the previous one's event; a
        fused bucket's graph does all three on the compute stream."""
        if fused:
            with on_stream(self._compute):
                self.graphs.replay(layer, bucket, slot.index)
                slot.downloaded.record(self._compute)
            return
        if bucket is not None:
            dev_in, dev_out = self.graphs.buffers(slot.index)
        else:
            dev_in, dev_out = slot.eager_buffers(layout, self.device)
        n_in, n_out = layout.in_prefix(m), layout.out_prefix(m)
        with on_stream(self._upload):
            dev_in[:n_in].copy_(slot.host.input[:n_in], non_blocking=True)
            slot.uploaded.record(self._upload)
        with on_stream(self._compute):
            self._compute.wait_event(slot.uploaded)
            if bucket is not None:
                self.graphs.replay(layer, bucket, slot.index)
            else:
                x, i, w = layout.inputs(dev_in)
                out, bad = layout.outputs(dev_out)
                forward_checked(self.bank.backend, state, x, i, w, out, bad)
            slot.computed.record(self._compute)
        with on_stream(self._download):
            self._download.wait_event(slot.computed)
            slot.host.output[:n_out].copy_(dev_out[:n_out], non_blocking=True)
            slot.downloaded.record(self._download)

    def _enqueue_device(
        self,
        slot: _Slot,
        layer: int,
        state,
        layout: Layout,
        bucket: int | None,
        m: int,
        xs,
        outs,
        alone: bool = False,
        bells=None,
    ) -> None:
        """`_enqueue` for inputs and outputs the copies reach directly (cuda-ipc slots'
        device memory, page-locked shm slots): the routes go up from the host buffer,
        each request's x is copied (device to device, or DMA from the host slot) into
        the packed input, the graph of the bucket (the one without host copies) or the
        eager forward runs, then each request's rows are copied into its output and
        only the NaN/Inf flags come down to the host.

        `alone` (no other batch in flight): nothing to overlap with, so every step is
        queued on the compute stream in order, without the three streams' events and
        waits (a handful of host calls of a call that is mostly host time when small)."""
        views = self._views.get((slot.index, bucket)) if bucket is not None else None
        if views is None or not views.current(slot):
            if bucket is not None:
                dev_in, dev_out = self.graphs.buffers(slot.index)
            else:
                dev_in, dev_out = slot.eager_buffers(layout, self.device)
            views = _DeviceViews(layout, slot, dev_in, dev_out)
            if bucket is not None:  # the graphs' buffers stay put: their views too
                self._views[(slot.index, bucket)] = views
        x_dev, out_dev = views.x, views.out
        upload, download = (
            (self._compute, self._compute) if alone else (self._upload, self._download)
        )
        copy_into(upload, views.routes_dev, views.routes_host)
        row = 0
        for x in xs:
            rows = x.shape[0]
            if rows:
                copy_into(upload, x_dev[row : row + rows], x)
                row += rows
        if not alone:
            slot.uploaded.record(upload)
        with on_stream(self._compute):
            if not alone:
                self._compute.wait_event(slot.uploaded)
            if bucket is not None:
                self.graphs.replay(layer, bucket, slot.index, plain=True)
            else:
                x, i, w = layout.inputs(views.dev_in)
                out, bad = layout.outputs(views.dev_out)
                forward_checked(self.bank.backend, state, x, i, w, out, bad)
            if not alone:
                slot.computed.record(self._compute)
        if not alone:
            download.wait_event(slot.computed)
        copy_into(download, views.flags_host, views.flags_dev)
        row = 0
        for x, out in zip(xs, outs, strict=True):
            rows = x.shape[0]
            if rows:
                copy_into(download, out, out_dev[row : row + rows])
                row += rows
        if bells is not None:
            for bell in bells:
                if bell is not None:
                    write_value(download, *bell)
        slot.downloaded.record(download)

    def _collect(self, flight: Flight) -> Result:
        """A flight's results: computed now off the GPU; on CUDA, after waiting for its
        download, viewed in the slot's pinned output."""
        if flight._host is not None:
            state, x, i, w = flight._host
            if flight.m == 0:
                out = torch.zeros((0, self.hidden), dtype=torch.bfloat16)
            else:
                out = self.bank.backend.forward(state, x, i, w)
            return Result.of(out, host_nonfinite_rows(x, w, out))
        flight._slot.downloaded.synchronize()
        return flight.staging.result(flight.layout, flight.m)
