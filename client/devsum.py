"""The partial sum on the caller's GPU, for a caller whose tensors live there.

The host sum (core.combine) reads every answer on the client's event loop and then
copies the result to the GPU. For a CUDA caller this module does it the other way
round: each shard's answer is staged into pinned host memory as soon as it arrives
and copied to the device on a side stream while the other shards' answers are still
on the wire; once all are in, they are added on the device in float32 in shard
order (zeros + index_add_, exactly the host sum's additions in the same order, so
the same bits) and rounded to bf16 there. The loop thread does one memcpy per
answer and never waits for a transfer, only for the final sum. Small answers
(HOST_SUM_MAX) skip it: the host sum and one copy cost less there.

The same code runs with device="cpu" (plain copies, no streams), and
tests/unit/test_device_sum.py checks its bits against the host sum there and, marked
`cuda`, on a GPU.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import torch

from expertd.client.core import Piece, _answer_bits
from expertd.cudamem import on_stream

# A CUDA caller's answers of up to this many elements in all (rows x hidden size) are
# summed on the host and the result copied to its GPU once (core.combine, core.to_caller):
# staging each answer to the device and summing there costs host calls that the host sum
# of that many elements undercuts. H100 host, one shard over gRPC, H = 512, mean us of
# the sum stage, on the device / on the host: 512 elements 223 / 118, 8K 152 / 120, 32K
# 280 / 129, 64K 288 / 143, 128K 265 / 180, 512K 289 / 386.
HOST_SUM_MAX = 1 << 17

_ALIGN = 64  # bytes: every staged region starts aligned (for the int64 row indices)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _PinnedPool:
    """Pinned host buffers kept between calls (pinning costs milliseconds): a call
    takes one large enough for its answers and gives it back once its copies are
    done. Calls in flight at once hold different buffers."""

    KEEP = 4

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int, pin: bool) -> torch.Tensor:
        with self._lock:
            fits = [
                i for i, b in enumerate(self._free) if b.numel() >= nbytes and b.is_pinned() == pin
            ]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(_aligned(max(nbytes, 1)), dtype=torch.uint8, pin_memory=pin)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self.KEEP:  # keep the largest
                self._free.sort(key=torch.Tensor.numel)
                del self._free[0]


_POOL = _PinnedPool()
_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _stream(device: torch.device):
    """One side stream per device for every call's copies and sums (they queue in
    call order); None on CPU."""
    if device.type != "cuda":
        return None
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device)
    return stream


class DeviceSum:
    """One call's answers, staged to `device` as they arrive, summed there.

    `stage(piece)` as each shard answers (on the client's event loop; answers may
    come in any order), then `finish(pieces)` with the call's pieces in the order
    core.combine would get them -> bf16 [m, h] on `device`, complete (the side
    stream synchronized) so that any stream of the caller may read it; or, given
    `done` and a lone answer already on `device` (one cuda-ipc slot with every row),
    queued on the caller's current stream like any torch op, with `done` recorded
    after it: the caller keeps the answer's memory until `done` has passed.
    `rows` sizes the pinned buffer: the rows the answers are expected to hold (an
    answer that does not fit gets a pinned buffer of its own)."""

    def __init__(self, m: int, hidden_size: int, device: torch.device, rows: int) -> None:
        self.m, self.h = m, hidden_size
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self.stream = _stream(self.device)
        # room for the rows, and for the alignment of up to 64 answers; taken when the
        # first host answer is staged (answers already on the GPU need none)
        self._rows = rows
        self._host: torch.Tensor | None = None
        self._extra: list[torch.Tensor] = []  # pinned buffers of answers that did not fit
        self._used = 0
        self._staged: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._on_side = False  # something was queued on the side stream
        self.queued = False  # finish left the sum queued on the caller's stream

    def _region(self, nbytes: int) -> torch.Tensor:
        if self._host is None:
            self._host = _POOL.take(self._rows * (2 * self.h + 8) + 128 * _ALIGN, self.pin)
        start = self._used
        if start + nbytes <= self._host.numel():
            self._used = _aligned(start + nbytes)
            return self._host[start : start + nbytes]
        buf = torch.empty(_aligned(nbytes), dtype=torch.uint8, pin_memory=self.pin)
        self._extra.append(buf)
        return buf[:nbytes]

    def _on_stream(self):
        return on_stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def stage(self, piece: Piece) -> None:
        """Copy `piece`'s answer into pinned memory (one memcpy, numpy) and start its
        copy to the device; its tokens go along unless it holds every row. An answer
        already on a GPU (a cuda-ipc slot's output region) is read where it is."""
        if isinstance(piece.output, torch.Tensor) and piece.output.is_cuda and self.pin:
            self._stage_device(piece)
            return
        bits = _answer_bits(piece, self.h)  # uint16 [rows, h]; raises naming what is wrong
        rows = bits.shape[0]
        if rows == 0:
            return
        full = rows == self.m  # distinct rows of the call, ascending: all of them, in order
        nbytes = rows * self.h * 2
        region = self._region(_aligned(nbytes) + (0 if full else rows * 8))
        np.copyto(region[:nbytes].numpy().view(np.uint16).reshape(rows, self.h), bits)
        host_bits = region[:nbytes].view(torch.int16).view(torch.bfloat16).view(rows, self.h)
        host_tokens = None
        if not full:
            off = _aligned(nbytes)
            host_tokens = region[off : off + rows * 8].view(torch.int64)
            np.copyto(host_tokens.numpy(), piece.tokens.numpy())
        self._on_side = True
        with self._on_stream():
            dev_bits = host_bits.to(self.device, non_blocking=self.pin)
            dev_tokens = None
            if host_tokens is not None:
                dev_tokens = host_tokens.to(self.device, non_blocking=self.pin)
        self._staged[id(piece)] = (dev_tokens, dev_bits)

    def _stage_device(self, piece: Piece) -> None:
        out = piece.output
        rows = piece.tokens.numel()
        if tuple(out.shape) != (rows, self.h) or out.dtype != torch.bfloat16:
            raise ValueError(
                f"slot answer of shape {list(out.shape)} {out.dtype}, expected "
                f"[{rows}, {self.h}] bfloat16"
            )
        if rows == 0:
            return
        if out.device == self.device and rows == self.m:  # read where it is, when summed
            self._staged[id(piece)] = (None, out)
            return
        self._on_side = True
        with self._on_stream():
            bits = out if out.device == self.device else out.to(self.device, non_blocking=True)
            tokens = None
            if rows != self.m:  # page-locked: queued on the side stream, no host wait
                tokens = piece.tokens.pin_memory().to(self.device, non_blocking=True)
        self._staged[id(piece)] = (tokens, bits)

    def finish(self, pieces: list[Piece], done: torch.cuda.Event | None = None) -> torch.Tensor:
        """Sum the staged answers of `pieces` in shard order -> bf16 [m, h] on the device.
        `done`: see the class; `self.queued` says whether it was recorded (the sum left
        queued on the caller's stream) or not (complete, as without it)."""
        staged = [self._staged[id(p)] for p in pieces if id(p) in self._staged]
        # One answer with every row (one shard, or all routes on one) is 0.0f + it, rounded
        # back, in one kernel (CUDA's bf16 add computes in float32 and rounds as
        # .to(bfloat16): -0 -> +0, NaN -> 0x7FC0, as the host sum).
        lone = len(staged) == 1 and staged[0][0] is None
        self.queued = done is not None and lone and not self._on_side
        if self.queued:  # on this GPU, nothing of it on the side stream: the caller's stream
            out = torch.add(staged[0][1], 0.0)
            done.record()
            self._staged.clear()
            return out
        try:
            # The result is allocated on this thread's current stream, as a host result's
            # copy to the device would be; everything else lives on the side stream.
            out = torch.empty((self.m, self.h), dtype=torch.bfloat16, device=self.device)
            if self.stream is not None:  # out's memory may have been in use there until now
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with self._on_stream():
                if self.stream is not None and lone:
                    torch.add(staged[0][1], 0.0, out=out)
                else:
                    total = torch.zeros((self.m, self.h), dtype=torch.float32, device=self.device)
                    for piece in sorted(pieces, key=lambda p: p.shard):  # stable: combine's order
                        entry = self._staged.get(id(piece))
                        if entry is None:  # an empty answer
                            continue
                        tokens, bits = entry
                        if tokens is None:
                            total.add_(bits.float())
                        else:
                            total.index_add_(0, tokens, bits.float())
                    out.copy_(total)  # round to nearest even, as .to(bfloat16)
            if self.stream is not None:
                self.stream.synchronize()  # done: the caller's streams may read it, buffers reusable
            self._staged.clear()  # nothing of them is queued any more
            return out
        finally:
            self.close()

    def close(self) -> None:
        """Give the pinned buffer back (once the copies that read it are done)."""
        if self._host is None and not self._staged:
            return
        if self.stream is not None:
            self.stream.synchronize()
        if self._host is not None:
            _POOL.give(self._host)
            self._host = None
        self._extra.clear()
        self._staged.clear()
