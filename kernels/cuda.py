"""The `cuda` backend: our CUDA kernels (kernels/csrc/moe_nvfp4.cu) through a C ABI and ctypes.

Importing this module needs neither nvcc nor a GPU: the library is built (ninja + nvcc, see
kernels/build.py; once, under a lock) and loaded on first use, or loaded from EXPERTD_KERNEL_LIB.
The backend refuses a GPU whose compute capability is not 9.0 (the library is sm_90a). The forward makes no host sync and, once the
workspace is large enough, no device allocation of its own, so it can be captured in a CUDA
graph (`GraphedForward` does that for a fixed token count).

Shape legend: M tokens, K top_k, H hidden, I intermediate, E experts, El local experts.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass

import torch

from expertd.kernels.backend import register_backend
from expertd.kernels.build import capability_problem
from expertd.kernels.layer import ShardLayer
from expertd.kernels.repack import PackedProjection, repack_down, repack_gate_up


class _Args(ctypes.Structure):
    # Mirrors struct ExpertdMoeArgs in moe_nvfp4.cu, field for field.
    _fields_ = [
        ("x", ctypes.c_void_p),
        ("topk_ids", ctypes.c_void_p),
        ("topk_weights", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("local_of", ctypes.c_void_p),
        ("w13_codes", ctypes.c_void_p),
        ("w13_scales", ctypes.c_void_p),
        ("w13_gscale", ctypes.c_void_p),
        ("w2_codes", ctypes.c_void_p),
        ("w2_scales", ctypes.c_void_p),
        ("w2_gscale", ctypes.c_void_p),
        ("norm_weight", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_longlong),
        ("m", ctypes.c_longlong),
        ("top_k", ctypes.c_int),
        ("h", ctypes.c_int),
        ("inter", ctypes.c_int),
        ("num_experts", ctypes.c_int),
        ("el", ctypes.c_int),
        ("bt", ctypes.c_int),
        ("stream", ctypes.c_void_p),
        ("local_first", ctypes.c_int),
        ("rms_norm", ctypes.c_int),
    ]


class GraphCallPlan(ctypes.Structure):
    """Mirrors struct expertd_graph_call_plan in graph_call.cu: where in its block (host
    addresses) one call of a lane graph leaves its routes and finds its flags, the graph's
    rows, the stream, event and driver entry points it uses, and the last failure's text."""

    _fields_ = [
        ("header", ctypes.c_void_p),
        ("ids_host", ctypes.c_void_p),
        ("weights_host", ctypes.c_void_p),
        ("flags_host", ctypes.c_void_p),
        ("rows", ctypes.c_int),
        ("top_k", ctypes.c_int),
        ("num_experts", ctypes.c_int),
        ("pad_", ctypes.c_int),
        ("stream", ctypes.c_void_p),
        ("event", ctypes.c_void_p),
        ("launch", ctypes.c_void_p),
        ("write", ctypes.c_void_p),
        ("record", ctypes.c_void_p),
        ("sync", ctypes.c_void_p),
        ("error", ctypes.c_char * 160),
    ]


CALL_HEADER_BYTES = 64  # struct expertd_call_header (call_block.h)


@dataclass(frozen=True, slots=True)
class CallBlock:
    """Where a lane call's block (call_block.h) keeps its parts, as byte offsets: the
    header, then a graph of `rows` tokens' ids int32 [rows, top_k] and weights fp32
    [rows, top_k] (room for `capacity` rows), then flags [capacity]."""

    capacity: int
    top_k: int

    @property
    def ids_offset(self) -> int:
        return CALL_HEADER_BYTES

    def weights_offset(self, rows: int) -> int:
        return CALL_HEADER_BYTES + 4 * rows * self.top_k

    def call_bytes(self, rows: int) -> int:
        """The header and a `rows`-token graph's routes: what its graph copies in."""
        return CALL_HEADER_BYTES + 8 * rows * self.top_k

    @property
    def flags_offset(self) -> int:
        return CALL_HEADER_BYTES + 8 * self.capacity * self.top_k

    @property
    def nbytes(self) -> int:
        return self.flags_offset + self.capacity


# expertd_graph_call's answers (graph_call.cu)
GRAPH_CALL_OK, GRAPH_CALL_BAD_ID, GRAPH_CALL_NONFINITE, GRAPH_CALL_FAILED = 0, 1, 2, -1


def graph_call_fn():
    """The library's `expertd_graph_call` (graph_call.cu): one small call of a captured
    forward, run without the interpreter's lock; AttributeError in a library built before
    it existed."""
    return load_library().expertd_graph_call


_LIB: ctypes.CDLL | None = None
_OPENED: dict[str, ctypes.CDLL] = {}
_LIB_LOCK = threading.RLock()
_INITIALIZED: set[tuple[int, int]] = set()  # (library handle, device index)


def _declare_graph_call(fn) -> None:
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.POINTER(GraphCallPlan),
        ctypes.c_void_p,  # graph exec
        ctypes.c_int,  # m
        ctypes.c_int,  # k
        ctypes.c_void_p,  # ids
        ctypes.c_void_p,  # weights
        ctypes.c_uint64,  # x
        ctypes.c_uint64,  # out
        ctypes.c_uint64,  # bell address (0: none)
        ctypes.c_uint32,  # bell value
    ]


def _declare_rows(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.expertd_nonfinite_rows.restype = i
    lib.expertd_nonfinite_rows.argtypes = [p, p, p, p, ctypes.c_longlong, i, i, p]
    lib.expertd_call_in.restype = lib.expertd_call_out.restype = i
    lib.expertd_call_in.argtypes = [p, p, p, p, i, i, i, p]
    lib.expertd_call_out.argtypes = [p, p, p, p, p, i, i, i, p]


def open_library(path: str | os.PathLike) -> ctypes.CDLL:
    """Load the kernel library at `path` (once per path) with its C functions declared."""
    key = os.path.realpath(path)
    with _LIB_LOCK:
        lib = _OPENED.get(key)
        if lib is None:
            lib = ctypes.CDLL(key)
            lib.expertd_last_error.restype = ctypes.c_char_p
            lib.expertd_pick_bt.restype = ctypes.c_int
            lib.expertd_pick_bt.argtypes = [ctypes.c_longlong] + [ctypes.c_int] * 4
            lib.expertd_workspace_bytes.restype = ctypes.c_longlong
            lib.expertd_workspace_bytes.argtypes = [
                ctypes.c_longlong,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
            ]
            lib.expertd_init.restype = ctypes.c_int
            lib.expertd_kernel_path.restype = ctypes.c_int
            lib.expertd_kernel_path.argtypes = [ctypes.c_int]
            lib.expertd_moe_forward.restype = ctypes.c_int
            lib.expertd_moe_forward.argtypes = [ctypes.POINTER(_Args)]
            if hasattr(lib, "expertd_graph_call"):  # absent from a library built before it
                _declare_graph_call(lib.expertd_graph_call)
            if hasattr(lib, "expertd_nonfinite_rows"):
                _declare_rows(lib)
            _OPENED[key] = lib
        return lib


def load_library() -> ctypes.CDLL:
    """Build (first time) and load the kernel library (kernels/build.py: library_path)."""
    global _LIB
    with _LIB_LOCK:
        if _LIB is None:
            from expertd.kernels.build import library_path

            _LIB = open_library(library_path())
        return _LIB


def kernel_path(bt: int) -> int:
    """The GEMM path of a forward with tile size `bt`: 6 (mma.sync, BT 8), 8 (wgmma, BT 16 to
    160), 0 when the library has no configuration for `bt` (moe_nvfp4.cu)."""
    return int(load_library().expertd_kernel_path(bt))


def pick_bt(m: int, top_k: int, num_experts: int, hidden: int, inter: int) -> int:
    """The tile size the library picks for a call (expertd_pick_bt)."""
    return int(load_library().expertd_pick_bt(m, top_k, num_experts, hidden, inter))


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: {lib.expertd_last_error().decode(errors='replace')}")


@dataclass(slots=True)
class CudaState:
    """One layer, resident on the GPU in the kernels' layout."""

    w13: PackedProjection  # [El, 2I/16, H/64, ...] gate/up interleaved
    w13_gscale: torch.Tensor  # fp32 [El, 2]: (gate, up) weight_scale_2
    w2: PackedProjection  # [El, H/16, I/64, ...]
    w2_gscale: torch.Tensor  # fp32 [El]
    norm_weight: torch.Tensor  # bf16 [H] (zeros for a layer without a post-expert norm)
    rms_norm: bool  # the post-expert RMS norm applies (muse-spark); off: out = sum w * z
    local_of: torch.Tensor  # int32 [E + 1]
    local_first: int  # the first owned id when they are a range (no table lookups), else -1
    hidden_size: int
    intermediate_size: int
    num_experts: int
    num_local_experts: int

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.w13.codes,
            self.w13.scales,
            self.w13_gscale,
            self.w2.codes,
            self.w2.scales,
            self.w2_gscale,
            self.norm_weight,
            self.local_of,
        )


def _range_start(experts: tuple[int, ...]) -> int:
    """The first id when the owned experts are consecutive ids in order, else -1."""
    first = experts[0] if experts else -1
    return first if tuple(experts) == tuple(range(first, first + len(experts))) else -1


def prepare_state(layer: ShardLayer, device: torch.device) -> CudaState:
    """Checkpoint-form layer -> resident state (repack on the GPU)."""
    h, i = layer.hidden_size, layer.intermediate_size
    if h % 256 or i % 256:
        raise ValueError(f"the cuda backend needs H and I multiples of 256, got H={h}, I={i}")
    layer = layer.to(device)
    w13 = repack_gate_up(layer.gate, layer.up)
    w2 = repack_down(layer.down)
    gs13 = torch.stack(
        (layer.gate.weight_scale_2.float(), layer.up.weight_scale_2.float()), dim=1
    ).contiguous()
    return CudaState(
        w13=w13,
        w13_gscale=gs13,
        w2=w2,
        w2_gscale=layer.down.weight_scale_2.float().contiguous(),
        # Without a post-expert norm, (1 + 0) leaves z = W2 a, and rms_norm = 0 drops the RMS.
        norm_weight=(
            torch.zeros(h, dtype=torch.bfloat16, device=device)
            if layer.norm_weight is None
            else layer.norm_weight.to(torch.bfloat16).contiguous()
        ),
        rms_norm=layer.norm_weight is not None,
        local_of=layer.global_to_local(device),
        local_first=_range_start(layer.experts),
        hidden_size=h,
        intermediate_size=i,
        num_experts=layer.num_experts,
        num_local_experts=layer.num_local_experts,
    )


class CudaBackend:
    """Backend `cuda`: repacked NVFP4 weights, our kernels, workspace sized for `max_tokens`.

    `forward` allocates only its output (from torch's caching allocator; capturable) and grows
    the shared workspace when a call needs more than any before it (a real allocation: warm up
    with the largest M before capturing graphs, or pass `max_tokens`). `forward_into` writes into
    a caller's buffer.
    """

    name = "cuda"

    def __init__(
        self,
        device: torch.device | str = "cuda",
        max_tokens: int = 0,
        *,
        library: str | os.PathLike | None = None,
    ) -> None:
        """`library`: the path of another build of the kernel library to run (a benchmark timing
        two builds in one process); None: the default build (load_library)."""
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"the cuda backend runs on a cuda device, not {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        where = f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        why = capability_problem(where, torch.cuda.get_device_capability(self.device))
        if why:  # sm_90a code on another GPU fails at the first launch, less clearly
            raise ValueError(f"backend cuda: {why}")
        self.max_tokens = max_tokens
        self._workspace: torch.Tensor | None = None
        self._lib = load_library() if library is None else open_library(library)
        with torch.cuda.device(self.device):
            key = (self._lib._handle, self.device.index)
            if key not in _INITIALIZED:
                _check(self._lib, self._lib.expertd_init(), "expertd_init")
                _INITIALIZED.add(key)

    # -- Backend protocol ---------------------------------------------------------------------

    def prepare(self, layer: ShardLayer) -> CudaState:
        state = prepare_state(layer, self.device)
        if self.max_tokens:
            self.reserve(state, self.max_tokens, top_k=8)
        return state

    def forward(self, state: CudaState, x, topk_ids, topk_weights) -> torch.Tensor:
        out = torch.empty((x.shape[0], state.hidden_size), dtype=torch.bfloat16, device=x.device)
        return self.forward_into(state, x, topk_ids, topk_weights, out)

    def resident_bytes(self, state: CudaState) -> int:
        return sum(t.numel() * t.element_size() for t in state.tensors())

    # -- workspace and the call ---------------------------------------------------------------

    def workspace_bytes(self, state: CudaState, m: int, top_k: int) -> int:
        return int(
            self._lib.expertd_workspace_bytes(
                m,
                top_k,
                state.hidden_size,
                state.intermediate_size,
                state.num_local_experts,
            )
        )

    def reserve(self, state: CudaState, m: int, top_k: int) -> torch.Tensor:
        """Make the workspace large enough for m tokens x top_k (allocates only when growing)."""
        need = self.workspace_bytes(state, m, top_k)
        if self._workspace is None or self._workspace.numel() < need:
            # zero-filled (a memset only when it grows): bytes no call has written read as zeros
            self._workspace = torch.zeros(need, dtype=torch.uint8, device=self.device)
        return self._workspace

    def forward_into(
        self,
        state: CudaState,
        x: torch.Tensor,  # bf16 [M, H]
        topk_ids: torch.Tensor,  # int32 [M, K] (int64 accepted: converted, an extra kernel)
        topk_weights: torch.Tensor,  # fp32 [M, K] (bf16 accepted: converted)
        out: torch.Tensor,  # bf16 [M, H]
        bt: int = 0,  # tokens per tile (a compiled one: 8, 16, 32, ... 160); 0 = expertd_pick_bt
    ) -> torch.Tensor:
        h = state.hidden_size
        if x.dim() != 2 or x.shape[1] != h or x.dtype != torch.bfloat16:
            raise ValueError(f"x must be bf16 [M, {h}], got {x.dtype} {tuple(x.shape)}")
        m = x.shape[0]
        if topk_ids.dim() != 2 or topk_ids.shape[0] != m or topk_ids.shape[1] < 1:
            raise ValueError(f"topk_ids must be [{m}, top_k], got {tuple(topk_ids.shape)}")
        if tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise ValueError(
                f"topk_weights {tuple(topk_weights.shape)} must match topk_ids "
                f"{tuple(topk_ids.shape)}"
            )
        if tuple(out.shape) != (m, h) or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise ValueError(f"out must be contiguous bf16 [{m}, {h}]")
        for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the backend on {self.device}")
        if topk_ids.dtype != torch.int32:
            topk_ids = topk_ids.to(torch.int32)
        if topk_weights.dtype != torch.float32:
            topk_weights = topk_weights.float()
        x, topk_ids, topk_weights = (
            x.contiguous(),
            topk_ids.contiguous(),
            topk_weights.contiguous(),
        )
        top_k = topk_ids.shape[1]
        if m == 0:
            return out
        # The kernels move 16-byte chunks of x's rows and out's rows: a view that starts between
        # them (a slice of a larger buffer) would fault the context. Such x is copied; such out
        # gets the result through an aligned buffer.
        if x.data_ptr() % 16:
            x = x.clone()
        dest = out
        if out.data_ptr() % 16:
            out = torch.empty_like(out)
        ws = self.reserve(state, m, top_k)
        args = _Args(
            x=x.data_ptr(),
            topk_ids=topk_ids.data_ptr(),
            topk_weights=topk_weights.data_ptr(),
            out=out.data_ptr(),
            local_of=state.local_of.data_ptr(),
            w13_codes=state.w13.codes.data_ptr(),
            w13_scales=state.w13.scales.data_ptr(),
            w13_gscale=state.w13_gscale.data_ptr(),
            w2_codes=state.w2.codes.data_ptr(),
            w2_scales=state.w2.scales.data_ptr(),
            w2_gscale=state.w2_gscale.data_ptr(),
            norm_weight=state.norm_weight.data_ptr(),
            workspace=ws.data_ptr(),
            workspace_bytes=ws.numel(),
            m=m,
            top_k=top_k,
            h=h,
            inter=state.intermediate_size,
            num_experts=state.num_experts,
            el=state.num_local_experts,
            bt=bt,
            stream=torch.cuda.current_stream(self.device).cuda_stream,
            local_first=state.local_first,
            rms_norm=int(state.rms_norm),
        )
        with torch.cuda.device(self.device):
            _check(self._lib, self._lib.expertd_moe_forward(ctypes.byref(args)), "moe forward")
        if dest is not out:
            dest.copy_(out)
        return dest

    # -- the per-row kernels (rows.cu) --------------------------------------------------------

    def has_row_kernels(self) -> bool:
        """Whether the library has rows.cu's kernels (one built before them has not)."""
        return hasattr(self._lib, "expertd_nonfinite_rows")

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def nonfinite_rows_into(self, x, weights, bad, output) -> torch.Tensor:
        """bad bool [M] <- row r of x (bf16 [M, H]), weights (fp32 [M, K]) or output (bf16
        [M, H]) holds NaN/Inf, in one launch on the current stream (what
        server.graphs.nonfinite_rows computes in nine torch ops)."""
        m, h = x.shape
        for name, t, shape, dtype in (
            ("x", x, (m, h), torch.bfloat16),
            ("output", output, (m, h), torch.bfloat16),
            ("weights", weights, (m, weights.shape[-1]), torch.float32),
            ("bad", bad, (m,), torch.bool),
        ):
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous {dtype} {list(shape)}")
        with torch.cuda.device(self.device):
            rc = self._lib.expertd_nonfinite_rows(
                x.data_ptr(),
                weights.data_ptr(),
                output.data_ptr(),
                bad.data_ptr(),
                m,
                h,
                weights.shape[1],
                self._stream(),
            )
        if rc:
            raise RuntimeError(f"expertd_nonfinite_rows: CUDA error {rc}")
        return bad

    def call_in(self, mirror: int, x, ids, weights) -> None:
        """A lane graph's first kernel on the current stream, after the copy of the block
        into its device mirror at `mirror`: the routes into ids and weights (every row),
        and the header's m rows of x into x (rows.cu)."""
        rows, h = x.shape
        args = (ids.data_ptr(), weights.data_ptr(), x.data_ptr(), rows, weights.shape[1], h)
        self._lane_step("expertd_call_in", mirror, *args)

    def call_out(self, mirror: int, flags: int, x, weights, out) -> None:
        """A lane graph's last kernel: the header's (at `mirror`) m rows of out to its
        destination, and each row's NaN/Inf flag (of x, weights and out) to `flags`, the
        host block's at its device address (rows.cu)."""
        rows, h = out.shape
        args = (x.data_ptr(), weights.data_ptr(), out.data_ptr(), rows, weights.shape[1], h)
        self._lane_step("expertd_call_out", mirror, flags, *args)

    def _lane_step(self, name: str, *args) -> None:
        with torch.cuda.device(self.device):
            rc = getattr(self._lib, name)(*args, self._stream())
        if rc:
            raise RuntimeError(f"{name}: CUDA error {rc}")


class GraphedForward:
    """One layer's forward for a fixed M and top_k, captured once in a CUDA graph.

    Copy inputs into `.x`, `.topk_ids`, `.topk_weights`, call `replay()`, read `.out`
    (or use `__call__`, which does the copies).
    """

    def __init__(
        self, backend: CudaBackend, state: CudaState, m: int, top_k: int, bt: int = 0
    ) -> None:
        dev = backend.device
        self.x = torch.zeros((m, state.hidden_size), dtype=torch.bfloat16, device=dev)
        self.topk_ids = torch.full((m, top_k), -1, dtype=torch.int32, device=dev)
        self.topk_weights = torch.zeros((m, top_k), dtype=torch.float32, device=dev)
        self.out = torch.empty((m, state.hidden_size), dtype=torch.bfloat16, device=dev)
        backend.reserve(state, m, top_k)
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):  # warm-up outside the capture
            backend.forward_into(state, self.x, self.topk_ids, self.topk_weights, self.out, bt)
        torch.cuda.current_stream(dev).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            backend.forward_into(state, self.x, self.topk_ids, self.topk_weights, self.out, bt)

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out

    def __call__(self, x, topk_ids, topk_weights) -> torch.Tensor:
        self.x.copy_(x)
        self.topk_ids.copy_(topk_ids)
        self.topk_weights.copy_(topk_weights)
        return self.replay()


register_backend("cuda", CudaBackend)
