"""What the sync and asyncio clients share outside the event loop: input
checks, staging to and from the caller's device, and the fixed-order float32
sum of the shards' partial outputs.

CUDA inputs are copied into pinned host buffers (one stream sync for all
three), and the result goes back from a pinned buffer with a non-blocking copy;
on CPU nothing is pinned (pinning needs a CUDA driver).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import numpy as np
import torch

from expertd import wire
from expertd.client.routing import ShardPart, Topology
from expertd.codec import ForwardRequestOut
from expertd.v1 import expertd_pb2 as pb


@dataclass(slots=True)
class Inputs:
    """One call's inputs, checked; ids and weights on the host. x is on the host too,
    except for a CUDA caller: there it stays on the GPU (`source`) until a transport
    needs it on the host (gRPC, shm; cuda-ipc slots read `source`)."""

    _x: torch.Tensor | None  # bf16 [M, H] on the host, once there
    ids: torch.Tensor  # int32 [M, K]
    weights: torch.Tensor  # float32 [M, K]
    device: torch.device  # where the caller wants the result
    source: torch.Tensor | None = None  # a CUDA caller's bf16 [M, H], contiguous, complete

    @property
    def pinned(self) -> bool:
        return self.device.type == "cuda"

    @property
    def m(self) -> int:
        return self.ids.shape[0]

    @property
    def x(self) -> torch.Tensor:
        """bf16 [M, H] on the host (copied from `source` on first use)."""
        if self._x is None:
            self._x = _to_host(self.source, torch.bfloat16)
            torch.cuda.current_stream(self.source.device).synchronize()
        return self._x

    @property
    def on_device(self) -> torch.Tensor:
        """x where it is: the caller's GPU tensor, else the host one."""
        return self.source if self.source is not None else self.x


def _to_host(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "cpu":
        if t.dtype == dtype and t.is_contiguous():
            return t
        return t.to(dtype).contiguous()
    host = torch.empty(t.shape, dtype=dtype, pin_memory=t.device.type == "cuda")
    host.copy_(t.to(dtype), non_blocking=True)
    return host


def stage_inputs(
    topology: Topology,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> Inputs:
    """Check shapes, dtypes and ids against the topology; copy to the host."""
    h = topology.hidden_size
    if hidden_states.dim() != 2 or hidden_states.shape[1] != h:
        raise ValueError(f"hidden_states: shape {tuple(hidden_states.shape)}, expected [M, {h}]")
    m = hidden_states.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != m:
        raise ValueError(f"topk_ids: shape {tuple(topk_ids.shape)}, expected [{m}, top_k]")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights: shape {tuple(topk_weights.shape)} != topk_ids {tuple(topk_ids.shape)}"
        )
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids: dtype {topk_ids.dtype}, expected an integer dtype")
    device = hidden_states.device
    source = None
    if device.type == "cuda":
        x = None
        source = hidden_states.detach().to(torch.bfloat16).contiguous()
    else:
        x = _to_host(hidden_states, torch.bfloat16)
    ids = _to_host(topk_ids, torch.int32)
    weights = _to_host(topk_weights, torch.float32)
    if device.type == "cuda" or topk_ids.is_cuda or topk_weights.is_cuda:
        for t in (hidden_states, topk_ids, topk_weights):
            if t.device.type == "cuda":
                torch.cuda.current_stream(t.device).synchronize()
                break
    if ids.numel():
        a = ids.numpy()  # numpy's reductions cost a fraction of torch's on a few ids
        if a.min() < -1 or a.max() >= topology.num_experts:
            raise ValueError(f"topk_ids: values must be in [-1, {topology.num_experts})")
    return Inputs(x, ids, weights, device, source)


# The client's per-call tensor work (each shard's rows, the sum of the answers) runs in numpy
# on the loop's thread, with no thread pool. Numpy was measured faster here than torch's CPU
# ops, and avoids their OpenMP region, at whose barrier a busy process's event-loop thread
# stalls. torch's CPU ops (index_add_ even for one row, indexing from a few thousand
# elements, elementwise ops above TORCH_INLINE_ELEMENTS) open such a region; in a busy
# process (shard servers beside it, the caller's threads) the loop thread then waits for a
# worker the OS has not run yet. The sum's only torch kernel is the float32 -> bf16
# rounding, in pieces small enough to run inline (one pass where numpy needs six).

# torch's elementwise CPU ops run inline up to this many elements (at::internal::
# GRAIN_SIZE): in a fresh process, copy_ of 32768 elements starts no OpenMP worker, of 32769
# it does (tests/unit/test_client_combine.py checks combine and forward_request start none).
TORCH_INLINE_ELEMENTS = 32768

# combine sums blocks of output rows of about this many elements, each block's answer rows
# staged as float32 in a per-thread buffer kept between calls (~4 bytes per element per
# answer holding a row: ~5.5 MiB at H = 4096; a fresh buffer that size costs more in page
# faults than the sum). 2^18 measured fastest of 2^16 to 2^20 at M = 256, and as fast as
# any at M = 1024.
COMBINE_BLOCK_ELEMENTS = 1 << 18

_scratch = threading.local()  # combine runs on whichever thread calls it


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    """A contiguous bf16 CPU tensor's bits as uint16 (a view)."""
    return t.view(torch.int16).numpy().view(np.uint16)


def host_bf16(m: int, h: int) -> tuple[torch.Tensor, np.ndarray]:
    """A new bf16 [m, h] host tensor and its bits (uint16, a view), in memory numpy
    allocated: numpy reuses freed blocks and backs a large array with huge pages, where
    torch.empty maps fresh 4 KiB pages that fault in on first write. Measured on the
    2-core machine, allocate and fill: 1 MiB 68 -> 28 us, 8 MiB 473 -> 228 us, 32 MiB
    (M = 4096 at H = 4096) 17.7 -> 4.0 ms."""
    bits = np.empty((m, h), np.uint16)
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16), bits


def forward_request(layer: int, inputs: Inputs, part: ShardPart) -> ForwardRequestOut:
    """This shard's request; its tensors reach the wire in one copy (expertd/codec.py):
    its rows are gathered (numpy: torch's indexing opens an OpenMP region) straight
    into the request's bytes."""
    if part.tokens.numel() == inputs.m:  # distinct rows, all of them: in order
        return ForwardRequestOut(layer, inputs.x, part.topk_ids, part.topk_weights)
    rows = part.tokens.numpy()
    return ForwardRequestOut(layer, inputs.x, part.topk_ids, part.topk_weights, rows=rows)


@dataclass(frozen=True, slots=True)
class Piece:
    """One shard's answer: its partial output for some of the call's tokens."""

    shard: int
    tokens: torch.Tensor  # int64 [Ms]: rows of the call, distinct and ascending
    # bf16 [Ms, H]: on the wire (a Tensor message), or bf16 bits uint16 [Ms, H] where
    # the shard wrote them (a shared-memory slot's output region, client/shm.py)
    output: pb.Tensor | np.ndarray
    address: str = ""  # the replica that answered
    timing: object = None  # the shard's Timing (pb.Timing or a dict of its fields)


def _answer_bits(piece: Piece, hidden_size: int) -> np.ndarray:
    """A piece's output as bf16 bits [Ms, H], viewed over the message's bytes."""
    msg = piece.output
    rows = piece.tokens.numel()
    if isinstance(msg, torch.Tensor):  # a cuda-ipc slot's output region, on a GPU
        msg = msg.cpu().view(torch.int16).numpy().view(np.uint16)
    if isinstance(msg, np.ndarray):  # a slot's output region: written by the shard as asked
        if msg.shape != (rows, hidden_size) or msg.dtype != np.uint16:
            raise ValueError(
                f"slot answer of shape {list(msg.shape)}, expected [{rows}, {hidden_size}]"
            )
        return msg
    data = msg.data  # a protobuf bytes field copies on each access: read it once
    shape = [rows, hidden_size]
    if msg.dtype == pb.BF16 and list(msg.shape) == shape and len(data) == rows * hidden_size * 2:
        return np.frombuffer(data, np.uint16).reshape(shape)
    partial = wire.decode(msg, "output")  # raises WireError naming what is malformed
    if tuple(partial.shape) != (rows, hidden_size):
        raise ValueError(
            f"shard returned output of shape {list(partial.shape)}, "
            f"expected [{rows}, {hidden_size}]"
        )
    raise ValueError(f"shard returned output of dtype {partial.dtype}, expected bfloat16")


def _buffer(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's scratch tensor `name` of at least `numel` elements (grown, never shrunk)."""
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        setattr(_scratch, name, buf)
    return buf


def combine(inputs: Inputs, hidden_size: int, pieces: list[Piece]) -> torch.Tensor:
    """Sum the partial outputs in float32 in shard order (independent of which
    answers first), round once to bf16 -> [M, H] on the host (pinned for CUDA).

    The same bits as zeros(M, H) + index_add_ of each answer in shard order, then .to(bf16)
    (NaN aside: as torch's conversion writes it), computed in numpy without index_add_'s
    gathers: within a block of output rows, rows are ordered by how many answers hold them,
    so each row's j-th addend (in shard order) lies in one dense slice for every j."""
    m, h = inputs.m, hidden_size
    answers = []  # (rows, bits) in shard order; the sort is stable: same order every time
    for piece in sorted(pieces, key=lambda p: p.shard):
        bits = _answer_bits(piece, h)
        if bits.size:
            answers.append((piece.tokens.numpy(), bits))
    if inputs.pinned:
        out = torch.empty((m, h), dtype=torch.bfloat16, pin_memory=True)
        out_bits = bf16_bits(out)
    else:
        out, out_bits = host_bf16(m, h)
    if not answers or m * h == 0:
        out_bits.fill(0)
        return out
    if len(answers) == 1 and answers[0][0].size == m:  # one answer with every row: 0 + it
        if m * h > SMALL_SUM_ELEMENTS:
            _one_answer(out_bits, answers[0][1])
        else:  # one table look-up (M = 1, one shard)
            np.take(_ZERO_PLUS, answers[0][1], out=out_bits)
        return out
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN sum as in torch
        if m * h <= SMALL_SUM_ELEMENTS:
            _sum_small(out_bits, answers)
        else:
            _sum(out, out_bits, answers)
    return out


# Up to this many output elements the sum runs as a few whole-array numpy operations
# (_sum_small): at M = 1 the blocked path's bookkeeping costs more than the additions.
SMALL_SUM_ELEMENTS = 8192


def _zero_plus() -> np.ndarray:
    """uint16 [65536]: the bf16 bits of 0.0f + x for each bf16 x, rounded back to bf16 as
    torch rounds: x itself, but +0 for -0 and 0x7FC0 for every NaN."""
    table = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    table[0x8000] = 0
    table[(table & 0x7FFF) > 0x7F80] = 0x7FC0
    return table


_ZERO_PLUS = _zero_plus()


def _sum_small(out_bits: np.ndarray, answers: list) -> None:
    """The sum for a small call: float32 zeros plus each answer in shard order (index_add_'s
    additions, so 0 + -0 = +0 as there), then rounded to bf16 as torch rounds: to nearest
    even, NaN as 0x7FC0."""
    m, h = out_bits.shape
    if all(rows.size == m for rows, _ in answers):  # every answer holds every row
        staged = np.stack([bits for _, bits in answers]).astype(np.uint32)
        np.left_shift(staged, 16, out=staged)
        f = staged.view(np.float32)
        acc = f[0]
        np.add(acc, np.float32(0), out=acc)
        for j in range(1, len(answers)):
            np.add(acc, f[j], out=acc)
    else:
        acc = np.zeros((m, h), np.float32)
        for rows, bits in answers:
            vals = (bits.astype(np.uint32) << 16).view(np.float32)
            if rows.size == m:
                np.add(acc, vals, out=acc)
            elif rows.size:
                if rows[0] < 0 or rows[-1] >= m or (rows[1:] <= rows[:-1]).any():
                    raise ValueError(
                        "an answer's tokens must be distinct rows of the call, ascending"
                    )
                acc[rows] += vals  # distinct rows: one addition each
    u = acc.view(np.uint32)
    r = u >> 16
    r &= 1
    r += 0x7FFF
    r += u  # wraps for some NaNs only, which are set below
    r >>= 16
    np.copyto(out_bits, r, casting="unsafe")
    nan = acc != acc
    if nan.any():
        out_bits[nan] = 0x7FC0


# _one_answer copies and checks this many elements at a time: the block just written is
# still in cache when it is scanned for -0 and NaN (whole-array passes and their
# temporaries cost three times as much at M = 4096).
ONE_ANSWER_BLOCK_ELEMENTS = 1 << 16


def _one_answer(out_bits: np.ndarray, bits: np.ndarray) -> None:
    """The sum of one answer holding every row: 0.0f + x rounded back to bf16 is x
    itself but for -0 (+0) and NaN (0x7FC0, as torch rounds it), so a copy and those
    two fixes, block by block. Within a block three reductions that allocate nothing
    find them: -0 is int16's least value, a NaN is above 0x7F80 as int16 (positive)
    or above 0xFF80 as uint16 (negative)."""
    flat_out, flat_in = out_bits.reshape(-1), bits.reshape(-1)
    n = flat_out.size
    for a in range(0, n, ONE_ANSWER_BLOCK_ELEMENTS):
        blk = flat_out[a : a + ONE_ANSWER_BLOCK_ELEMENTS]
        np.copyto(blk, flat_in[a : a + ONE_ANSWER_BLOCK_ELEMENTS])
        signed = blk.view(np.int16)
        if signed.min() == -0x8000:
            blk[blk == 0x8000] = 0
        if signed.max() > 0x7F80 or blk.max() > 0xFF80:
            blk[(blk & 0x7FFF) > 0x7F80] = 0x7FC0


def _sum(out: torch.Tensor, out_bits: np.ndarray, answers: list) -> None:
    m, h = out_bits.shape
    n_ans = len(answers)
    per = max(1, min(m, COMBINE_BLOCK_ELEMENTS // h))  # rows per block
    bounds = [*range(0, m, per), m]
    full = all(rows.size == m for rows, _ in answers)
    if full:  # every answer holds every row (M = 1 mostly): answer j is each row's j-th addend
        sizes = [[r1 - r0] * n_ans for r0, r1 in itertools.pairwise(bounds)]
        nonzero = [r1 - r0 for r0, r1 in itertools.pairwise(bounds)]
        perm = None
    else:
        sizes, nonzero, perm, dest, cuts = _plan(m, per, bounds, answers)
        offsets = np.cumsum([0] + [rows.size for rows, _ in answers]).tolist()
    staged = _buffer("staged", max(map(sum, sizes)) * h, torch.float32)
    staged_u = staged.numpy().view(np.uint32)
    rounded = _buffer("rounded", 0 if perm is None else per * h, torch.bfloat16)
    out_flat = out.view(-1)
    for b, (r0, r1) in enumerate(itertools.pairwise(bounds)):
        n, size = r1 - r0, sizes[b]
        start = [0, *itertools.accumulate(size)]  # region j: staged rows start[j]:start[j + 1]
        buf = staged_u[: start[-1] * h].reshape(-1, h)
        for a, (_, bits) in enumerate(answers):  # uint16 -> uint32 on the way in
            if full:
                buf[start[a] : start[a + 1]] = bits[r0:r1]
            elif (lo := cuts[a][b]) < (hi := cuts[a][b + 1]):
                buf[dest[lo:hi]] = bits[lo - offsets[a] : hi - offsets[a]]
        if nonzero[b] < n:
            buf[nonzero[b] : n] = 0  # rows no answer holds
        np.left_shift(buf, 16, out=buf)  # bf16 bits -> float32 (bf16 is float32's top half)
        f = buf.view(np.float32)
        acc = f[:n]
        for j in range(1, n_ans):  # the same additions as index_add_'s, in the same order
            if k := size[j]:
                np.add(acc[:k], f[start[j] : start[j] + k], out=acc[:k])
        # acc starts as the first addend, not 0 + it: -0.0 stays -0.0 where index_add_ from
        # zeros gives +0.0. Nothing else can round to bf16 -0 (0x8000): a sum of bf16 values
        # that is not zero is at least 2^-133 in size, which bf16 holds. So 0x8000 -> 0 below.
        dst = out_flat[r0 * h : r1 * h] if perm is None else rounded[: n * h]
        sums = staged[: n * h].split(TORCH_INLINE_ELEMENTS)
        for d, s in zip(dst.split(TORCH_INLINE_ELEMENTS), sums, strict=True):
            d.copy_(s)  # round to nearest even, on this thread (no OpenMP region at this size)
        got = bf16_bits(dst).reshape(n, h)
        if got.view(np.int16).min() == -0x8000:  # bf16 -0 is int16's least value: one pass
            got[got == 0x8000] = 0
        if perm is not None:
            out_bits[perm[r0:r1]] = got


def _plan(m: int, per: int, bounds: list[int], answers: list):
    """Where each answer row goes in its block's staging buffer.

    Within a block, rows are ordered by how many answers hold them, descending: the rows
    with a j-th addend (in shard order) are then the block's first size[j] rows. Region 0 of
    the buffer holds every row of the block (zero where no answer has it), region j >= 1 the
    j-th addends, each at its row's place. -> (sizes [block][j], rows with an addend per
    block, the rows' order (None: as they are), each entry's buffer row, each answer's
    entries per block as [answer][block] cuts into the entries)."""
    n_ans = len(answers)
    rows = np.concatenate([r for r, _ in answers])  # every entry (answer row), in shard order
    key = np.repeat(np.arange(n_ans), [r.size for r, _ in answers]) * m + rows
    if rows.min() < 0 or rows.max() >= m or (key[1:] <= key[:-1]).any():
        raise ValueError("an answer's tokens must be distinct rows of the call, ascending")
    # held[a, r]: answers up to a that hold row r. An entry's rank: how many earlier answers
    # hold its row; a row's count: how many answers hold it.
    held = np.zeros(n_ans * m, np.int16)
    held[key] = 1
    held = np.cumsum(held.reshape(n_ans, m), axis=0, dtype=np.int64)
    rank = held.ravel()[key] - 1
    count = held[-1]
    block = np.arange(m) // per
    n_blocks = len(bounds) - 1
    perm = np.argsort(block * (n_ans + 1) + (n_ans - count), kind="stable")
    place = np.empty(m, np.int64)
    place[perm] = np.arange(m) % per
    hist = np.bincount(block * (n_ans + 1) + count, minlength=n_blocks * (n_ans + 1))
    at_least = np.cumsum(hist.reshape(n_blocks, n_ans + 1)[:, ::-1], axis=1)[:, ::-1]
    size = at_least[:, 1:].copy()  # size[b, j]: rows of block b with count > j ...
    size[:, 0] = at_least[:, 0]  # ... but region 0 holds them all
    start = np.zeros_like(size)
    np.cumsum(size[:, :-1], axis=1, out=start[:, 1:])
    dest = start[block[rows], rank] + place[rows]
    cuts = np.searchsorted(key, (np.arange(n_ans)[:, None] * m + np.array(bounds)).ravel())
    cuts = cuts.reshape(n_ans, n_blocks + 1).tolist()
    in_order = (perm == np.arange(m)).all()
    return size.tolist(), at_least[:, 1].tolist(), None if in_order else perm, dest, cuts


def to_caller(out: torch.Tensor, inputs: Inputs, non_blocking: bool = True) -> torch.Tensor:
    """The host result onto the caller's device: non-blocking from pinned memory
    when run on the caller's thread (so the copy is ordered on its stream)."""
    if inputs.device.type == "cpu":
        return out
    return out.to(inputs.device, non_blocking=non_blocking and inputs.pinned)
