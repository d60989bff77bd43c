"""CUDA graphs of a backend's forward at bucketed token counts, over packed buffers.

Small batches are launch-bound: a graph replays the whole forward (routing,
both GEMMs, the norm and sum, the NaN/Inf check of the inputs) as one launch.
A call with M tokens runs the graph of the smallest bucket >= M: rows past M
have no routes (ids -1) and cost nothing.

Each graph reads its inputs from, and writes its results into, one packed
device buffer per direction (`Layout`), so one copy moves a batch in and one
copy brings its output and NaN/Inf flags back. There are `slots` such buffer
pairs, each with its own graphs, so several batches can be in flight: one
being copied in while another computes and a third is copied out. All graphs
share one memory pool and run on one stream, one at a time.

Small buckets (up to `fused_rows` tokens) can also hold the two copies: given a
slot's pinned host buffers, their graph copies the bucket's whole input in,
runs the forward and copies the whole output back, so a small batch is one
replay instead of two copies, four events and a replay (each a Python call
into CUDA: ~160 us of host time at M = 1 on the H200 host against ~65 us).
The copies move the bucket's rows, not only the batch's, which costs little
below 64 rows (<= 0.5 MiB at H = 4096).

Lane graphs (for the pipeline slot `lane_slot`, given a backend with the row kernels
of kernels/csrc/rows.cu) serve one call at a time from a data-plane slot's own thread
(server/lane.py): each copies its call from a block of mapped host memory
(kernels/csrc/call_block.h: where the call's x lies in device memory, where its rows
go, how many, and its routes) into device memory in one DMA, copies x and the routes
in with its first kernel, runs the forward, and copies the rows out and writes their
NaN/Inf flags into the block with its last. A call is then one launch, whatever slot
of whatever client it came from.

Works with any backend that has `forward_into(state, x, ids, w, out)` and no
host sync or allocation inside it (the `cuda` backend).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
from dataclasses import dataclass, field

import numpy as np
import torch

log = logging.getLogger("expertd.server")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
ALIGN = 512  # bytes: every region of a packed buffer starts at a multiple (torch's own alignment)


def capturable(backend) -> bool:
    return backend.device.type == "cuda" and hasattr(backend, "forward_into")


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a batch of up to `rows` tokens lies in its two packed buffers (bytes):

        input   [ ids int32 rows x top_k | weights fp32 rows x top_k | x bf16 rows x hidden ]
        output  [ bad bool rows | out bf16 rows x hidden ]

    Every region starts at a multiple of ALIGN. A batch of m <= rows tokens moves
    the prefix up to x's row m in (the routes of all `rows` rows included, so
    padding rows arrive as "no route") and the prefix up to out's row m back
    (every row's flag included: they are a few bytes)."""

    rows: int
    top_k: int
    hidden: int
    weights_offset: int = field(init=False)
    x_offset: int = field(init=False)
    in_bytes: int = field(init=False)
    out_offset: int = field(init=False)
    out_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        if self.rows < 0 or self.top_k < 0 or self.hidden < 1:
            raise ValueError(f"bad layout: rows {self.rows}, top_k {self.top_k}, H {self.hidden}")
        routes = _aligned(4 * self.rows * self.top_k)
        object.__setattr__(self, "weights_offset", routes)
        object.__setattr__(self, "x_offset", 2 * routes)
        object.__setattr__(self, "in_bytes", 2 * routes + 2 * self.rows * self.hidden)
        object.__setattr__(self, "out_offset", _aligned(self.rows))
        object.__setattr__(self, "out_bytes", self.out_offset + 2 * self.rows * self.hidden)

    def in_prefix(self, m: int) -> int:
        """Bytes of the input buffer a batch of m tokens needs on the device."""
        self._check(m)
        return self.x_offset + 2 * m * self.hidden

    def out_prefix(self, m: int) -> int:
        """Bytes of the output buffer that hold a batch of m tokens' results."""
        self._check(m)
        return self.out_offset + 2 * m * self.hidden

    def _check(self, m: int) -> None:
        if not 0 <= m <= self.rows:
            raise ValueError(f"{m} tokens do not fit a layout of {self.rows} rows")

    def inputs(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views (x bf16 [rows, H], ids int32 [rows, K], weights fp32 [rows, K]) of a
        uint8 buffer of at least `in_bytes` (on any device)."""
        ids = _view(buf, 0, (self.rows, self.top_k), torch.int32)
        weights = _view(buf, self.weights_offset, (self.rows, self.top_k), torch.float32)
        x = _view(buf, self.x_offset, (self.rows, self.hidden), torch.bfloat16)
        return x, ids, weights

    def outputs(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (out bf16 [rows, H], bad bool [rows]) of a uint8 buffer of at least
        `out_bytes`."""
        out = _view(buf, self.out_offset, (self.rows, self.hidden), torch.bfloat16)
        bad = _view(buf, 0, (self.rows,), torch.bool)
        return out, bad


_ITEMSIZE = {torch.int32: 4, torch.float32: 4, torch.bfloat16: 2, torch.bool: 1}


def _view(buf: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype):
    size = _ITEMSIZE[dtype]
    count = math.prod(shape)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < offset + count * size:
        raise ValueError(
            f"need a flat uint8 buffer of at least {offset + count * size} bytes, got "
            f"{buf.dtype} {tuple(buf.shape)}"
        )
    return buf[offset : offset + count * size].view(dtype).view(shape)


def nonfinite_rows(
    x: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
):
    """bool [M]: the row's hidden states or route weights hold NaN/Inf, or (given
    the forward's `output`) its output does: finite but huge inputs overflow."""
    finite = torch.isfinite(x).all(dim=1) & torch.isfinite(weights).all(dim=1)
    if output is not None:
        finite &= torch.isfinite(output).all(dim=1)
    return torch.logical_not(finite, out=out) if out is not None else ~finite


# host_nonfinite_rows scans this many bf16 elements at a time (a block stays in cache).
HOST_SCAN_ELEMENTS = 1 << 16


def host_nonfinite_rows(x: torch.Tensor, weights: torch.Tensor, output: torch.Tensor):
    """nonfinite_rows for host tensors (x and output bf16 [M, H], weights float32 [M, K]),
    the same flags, in numpy: a bf16 value is NaN or Inf when its 8 exponent bits are all
    set, so a block whose bits OR 0x807F never reach 0xFFFF holds none and is passed after
    one reduction that allocates nothing. torch's isfinite on bf16 runs a scalar loop and
    allocates its masks; on the 2-core machine M = 1024, H = 512 took 2.5 ms that way,
    0.14 ms here, and M = 4096, H = 4096 166 ms against 7 ms."""
    m = x.shape[0]
    bad = ~np.isfinite(weights.numpy()).all(axis=1) if m else np.zeros(0, bool)
    rows = max(1, HOST_SCAN_ELEMENTS // max(1, x.shape[1]))
    for t in (x, output):
        bits = t.contiguous().view(torch.int16).numpy().view(np.uint16)
        for a in range(0, m, rows):
            block = bits[a : a + rows]
            if (block | 0x807F).max() == 0xFFFF:  # an element with every exponent bit set
                bad[a : a + rows] |= ((block & 0x7F80) == 0x7F80).any(axis=1)
    return torch.from_numpy(bad)


def forward_checked(backend, state, x, ids, weights, out, bad) -> None:
    """out <- the forward, bad <- nonfinite_rows of inputs and output, on the current
    stream. What a graph replays, and what an eager batch on the GPU runs (the same
    ops: the same bits). The cuda backend's check is one kernel (kernels/csrc/rows.cu)."""
    if hasattr(backend, "forward_into"):
        backend.forward_into(state, x, ids, weights, out)
    else:
        out.copy_(backend.forward(state, x, ids, weights))
    if _row_kernels(backend):
        backend.nonfinite_rows_into(x, weights, bad, out)
    else:
        nonfinite_rows(x, weights, out=bad, output=out)


def _row_kernels(backend) -> bool:
    return getattr(backend, "has_row_kernels", lambda: False)()


class GraphBank:
    """Graphs for (layer, bucket, slot) over each slot's packed device buffers."""

    def __init__(
        self,
        backend,
        hidden_size: int,
        top_k: int,
        buckets=DEFAULT_BUCKETS,
        slots: int = 1,
        fused_rows: int = 0,
        lane_slot: int | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.backend = backend
        self.fused_rows = fused_rows
        self.device = backend.device
        self.top_k = top_k
        self.buckets = sorted(buckets)
        self.slots = slots
        self.layouts = {m: Layout(m, top_k, hidden_size) for m in self.buckets}
        in_bytes = max(lay.in_bytes for lay in self.layouts.values())
        out_bytes = max(lay.out_bytes for lay in self.layouts.values())
        # One pair per slot, shared by that slot's buckets (a slot runs one batch at a time).
        self._in = [
            torch.zeros(in_bytes, dtype=torch.uint8, device=self.device) for _ in range(slots)
        ]
        self._out = [
            torch.zeros(out_bytes, dtype=torch.uint8, device=self.device) for _ in range(slots)
        ]
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        # fused buckets' graphs without the host copies (device inputs: cuda-ipc slots)
        self._plain: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self._keep: list[torch.Tensor] = []  # workspaces baked into graphs stay alive
        # slot lane_slot's lane graphs and its block of mapped host memory (module doc)
        self._lane: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (layer, bucket)
        self.lane_slot = lane_slot
        self.block: LaneBlock | None = None
        if lane_slot is not None and not 0 <= lane_slot < slots:
            raise ValueError(f"lane slot {lane_slot} outside [0, {slots})")
        # rows.cu moves 16-byte chunks of rows
        if lane_slot is not None and hidden_size % 8 == 0 and _row_kernels(backend):
            from expertd.kernels.cuda import CallBlock

            try:
                self.block = LaneBlock(CallBlock(self.buckets[-1], top_k), self.device)
            except Exception as e:  # host memory the driver would not map: no lane
                log.warning("no lane graphs: their host block could not be mapped (%s)", e)

    def buffers(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot's packed (input, output) device buffers: uint8, fixed addresses."""
        return self._in[slot], self._out[slot]

    def fused(self, bucket: int) -> bool:
        """Whether `bucket`'s graphs hold the copies in and out (see `capture`)."""
        return bucket <= self.fused_rows

    def fused_bytes(self) -> tuple[int, int]:
        """(input, output) bytes the host buffers of the fused buckets need."""
        small = [b for b in self.buckets if self.fused(b)]
        if not small:
            return 0, 0
        largest = self.layouts[small[-1]]  # buckets are sorted; sizes grow with rows
        return largest.in_bytes, largest.out_bytes

    def capture(self, layer: int, state, hosts=None) -> None:
        """Capture every (bucket, slot) of `layer` (outside any other capture; warms up first).

        `hosts[slot]` = (input, output): pinned uint8 host buffers of at least
        `fused_bytes()`, which must stay allocated as long as the graphs live.
        Given them, the fused buckets' graphs copy the bucket's whole input from
        `input` and its whole output into `output` around the forward."""
        if self.fused_rows and (hosts is None or len(hosts) != self.slots):
            raise ValueError(f"fused buckets need {self.slots} pairs of host buffers")
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for m in self.buckets:
                layout = self.layouts[m]
                self._keep.append(self.backend.reserve(state, self.buckets[-1], self.top_k))
                for slot in range(self.slots):
                    x, ids, weights = layout.inputs(self._in[slot])
                    out, bad = layout.outputs(self._out[slot])
                    x.zero_()
                    ids.fill_(-1)
                    weights.zero_()
                    args = (self.backend, state, x, ids, weights, out, bad)
                    if slot == 0:
                        forward_checked(*args)  # warm-up
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                        if self.fused(m):
                            host_in, host_out = hosts[slot]
                            n_in, n_out = layout.in_bytes, layout.out_bytes
                            self._in[slot][:n_in].copy_(host_in[:n_in], non_blocking=True)
                        forward_checked(*args)
                        if self.fused(m):
                            host_out[:n_out].copy_(self._out[slot][:n_out], non_blocking=True)
                    self._graphs[(layer, m, slot)] = graph
                    if self.fused(m):  # and one without the host copies, for device inputs
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                            forward_checked(*args)
                        self._plain[(layer, m, slot)] = graph
                    if self.block is not None and slot == self.lane_slot:
                        try:
                            graph = self._lane_graph(stream, state, m, x, ids, weights, out)
                        except Exception as e:  # the lane is an optimization: serve without
                            log.warning("no lane graphs: capturing one failed (%s)", e)
                            self.block = None
                            self._lane.clear()
                        else:
                            self._lane[(layer, m)] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _lane_graph(self, stream, state, m: int, x, ids, weights, out) -> torch.cuda.CUDAGraph:
        """Bucket m's lane graph over slot lane_slot's buffers: the block's header and
        routes copied into its device mirror (one DMA), call_in, the forward, call_out."""
        block = self.block
        n, mirror = block.shape.call_bytes(m), block.mirror.data_ptr()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            block.mirror[:n].copy_(block.host[:n], non_blocking=True)
            self.backend.call_in(mirror, x, ids, weights)
            self.backend.forward_into(state, x, ids, weights, out)
            self.backend.call_out(mirror, block.flags_ptr, x, weights, out)
        return graph

    def lane_exec(self, layer: int, bucket: int) -> int | None:
        """The driver handle (CUgraphExec) of (layer, bucket)'s lane graph (slot
        `lane_slot`'s buffers), for a caller that launches it itself (server/lane.py);
        None: no such graph."""
        graph = self._lane.get((layer, bucket))
        return None if graph is None else graph.raw_cuda_graph_exec()

    def bucket(self, layer: int, m: int, top_k: int) -> int | None:
        """The bucket whose graph runs (layer, m tokens, top_k), or None: run eager."""
        if m < 1 or top_k > self.top_k or m > self.buckets[-1]:
            return None
        bucket = next(b for b in self.buckets if b >= m)
        return bucket if (layer, bucket, 0) in self._graphs else None

    def replay(self, layer: int, bucket: int, slot: int, plain: bool = False) -> None:
        """Replay on the current stream: reads the slot's input buffer in
        `layouts[bucket]`, writes its output buffer. `plain`: without the host copies
        of a fused bucket (the caller moves the data)."""
        key = (layer, bucket, slot)
        graph = self._plain.get(key) if plain else None
        (graph or self._graphs[key]).replay()


_LANE_BLOCKS: list[LaneBlock] = []  # every block made, kept mapped and registered (LaneBlock)


class LaneBlock:
    """A slot's block for its lane graphs (kernels/csrc/call_block.h, `CallBlock` says
    where its parts lie): page-locked host memory mapped into the GPU's address space,
    written by the lane's C call, copied by the graph into `mirror` (device memory its
    kernels read) and given the flags by the graph, for as long as the process runs (the
    graphs keep its addresses). Every block is kept in `_LANE_BLOCKS`: one freed while
    still registered would leave its pages registered, and a later mapping at the same
    address could not be registered again."""

    def __init__(self, shape, device: torch.device) -> None:
        from expertd import cudamem

        self.shape = shape
        self._map = mmap.mmap(-1, -(-shape.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._pinned = cudamem.PinnedHost(self.addr, len(self._map), device, mapped=True)
        # where the graph's last kernel writes the flags
        self.flags_ptr = self._pinned.device_ptr + shape.flags_offset
        # the host side as a CPU tensor (registered: a copy from it is a DMA), its mirror
        self.host = torch.frombuffer(self._map, dtype=torch.uint8)
        self.mirror = torch.zeros(shape.flags_offset, dtype=torch.uint8, device=device)
        _LANE_BLOCKS.append(self)
