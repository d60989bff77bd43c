"""Host side of a batch's packed buffers (server/graphs.py `Layout`): gathering
the requests in, reading the results out, and the slots batches run in.

The gather is a numpy copy per request tensor into views of the packed (on
CUDA: pinned) input buffer, instead of a handful of torch ops per batch, each
with its Python and dispatch overhead. Padding is bookkeeping, not work: the
rows a batch leaves unused must say "no route" (id -1, weight 0), and only rows
that an earlier batch in the same buffer wrote can say anything else, so only
those are reset.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from expertd.server.graphs import Layout


@dataclass(frozen=True, slots=True)
class Result:
    """A batch's output rows as bytes (uint8 [M, 2H], the bf16 pattern) and its
    per-row "input or output was not finite" flags (bool [M]); numpy views, no copies."""

    out_bytes: np.ndarray
    bad_rows: np.ndarray

    @classmethod
    def of(cls, out: torch.Tensor, bad: torch.Tensor) -> Result:
        """From host tensors out bf16 [M, H] and bad bool [M]."""
        return cls(out.contiguous().view(torch.uint8).numpy(), bad.numpy())

    @property
    def out(self) -> torch.Tensor:
        """bf16 [M, H], sharing the bytes."""
        rows, width = self.out_bytes.shape
        if rows == 0:  # numpy's empty strides do not survive torch's dtype view
            return torch.zeros((0, width // 2), dtype=torch.bfloat16)
        return torch.from_numpy(self.out_bytes).view(torch.bfloat16)

    @property
    def bad(self) -> torch.Tensor:
        """bool [M], sharing the flags."""
        return torch.from_numpy(self.bad_rows)


def _as_bytes(x: torch.Tensor) -> np.ndarray:
    """bf16 [R, H] -> uint8 [R, 2H] over the same memory."""
    return x.contiguous().view(torch.uint8).numpy()


def _as_float32(w: torch.Tensor) -> np.ndarray:
    return (w if w.dtype == torch.float32 else w.float()).numpy()


class HostStaging:
    """One slot's packed host buffers: `input` (filled by `pack`) and `output` (the
    device copies the results there), uint8, pinned when `pin`; grown on demand,
    unless `fixed` (CUDA graphs copy from and to their addresses): then a layout
    that does not fit is refused."""

    def __init__(
        self, pin: bool, in_bytes: int = 0, out_bytes: int = 0, fixed: bool = False
    ) -> None:
        self.pin = pin
        self.fixed = False
        self.input = self._alloc(0)
        self.output = self._alloc(0)
        self._in_np = self.input.numpy()
        self._out_np = self.output.numpy()
        self._views: dict[Layout, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # The layout the input was last packed in and the rows that batch wrote;
        # None: unknown contents, reset every padding row next time.
        self._used: tuple[Layout, int] | None = None
        self.reserve(in_bytes, out_bytes)
        self.fixed = fixed

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def reserve(self, in_bytes: int, out_bytes: int) -> None:
        """Grow the buffers to at least these sizes (a no-op when they are)."""
        if self.fixed and (in_bytes > self.input.numel() or out_bytes > self.output.numel()):
            raise ValueError(
                f"fixed host buffers of {self.input.numel()} / {self.output.numel()} bytes "
                f"cannot take {in_bytes} / {out_bytes}"
            )
        if in_bytes > self.input.numel():
            self.input = self._alloc(in_bytes)
            self._in_np = self.input.numpy()
            self._views.clear()
            self._used = None
        if out_bytes > self.output.numel():
            self.output = self._alloc(out_bytes)
            self._out_np = self.output.numpy()

    def _input_views(self, layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        views = self._views.get(layout)
        if views is None:
            buf, r, k = self._in_np, layout.rows, layout.top_k
            ids = buf[: 4 * r * k].view(np.int32).reshape(r, k)
            w = buf[layout.weights_offset : layout.weights_offset + 4 * r * k]
            x = buf[layout.x_offset : layout.x_offset + 2 * r * layout.hidden]
            views = (x.reshape(r, 2 * layout.hidden), ids, w.view(np.float32).reshape(r, k))
            if len(self._views) > 64:  # eager layouts vary with M: keep the cache bounded
                self._views.clear()
            self._views[layout] = views
        return views

    def pack(self, layout: Layout, xs, ids, ws, with_x: bool = True) -> int:
        """Gather requests (x bf16 [R, H], ids int32/int64 [R, k], weights fp32/bf16
        [R, k], k <= layout.top_k) into `input` in `layout`; -> tokens M. Without
        `with_x` only the routes are gathered (x is on the device: cuda-ipc slots).

        Routes past a request's k, and rows from M to the layout's end, are "no
        route" (-1, 0) afterwards; x of rows past M is left as it was."""
        self.reserve(layout.in_bytes, layout.out_bytes)
        x_np, ids_np, w_np = self._input_views(layout)
        width = layout.top_k
        row = 0
        for x, i, w in zip(xs, ids, ws, strict=True):
            rows, k = i.shape
            if not rows:
                continue
            end = row + rows
            if end > layout.rows or k > width:
                raise ValueError(
                    f"batch does not fit layout: {end} rows x top_k {k} into "
                    f"{layout.rows} x {width}"
                )
            if with_x:
                x_np[row:end] = _as_bytes(x)
            ids_np[row:end, :k] = i.numpy()  # int64 ids are in [-1, E): the cast is exact
            w_np[row:end, :k] = _as_float32(w)
            if k < width:
                ids_np[row:end, k:] = -1
                w_np[row:end, k:] = 0.0
            row = end
        used = self._used
        dirty = used[1] if used is not None and used[0] == layout else layout.rows
        if dirty > row:
            ids_np[row:dirty] = -1
            w_np[row:dirty] = 0.0
        self._used = (layout, row)
        return row

    def result(self, layout: Layout, m: int) -> Result:
        """The first m rows of `output`, once the device has written it."""
        buf, off = self._out_np, layout.out_offset
        out = buf[off : off + 2 * m * layout.hidden].reshape(m, 2 * layout.hidden)
        return Result(out, buf[:m].view(np.bool_))


class SlotPool:
    """Which of `n` slots are free. A batch holds its slot from launch until its
    results have been read; callers keep at most `n` batches in flight (the
    batcher does, with a semaphore of n), so `acquire` never waits: it refuses."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"need at least one slot, got {n}")
        self.n = n
        self._free = deque(range(n))
        self._lock = threading.Lock()

    def acquire(self) -> int:
        with self._lock:
            if not self._free:
                raise RuntimeError(
                    f"all {self.n} slots hold batches in flight: release one before launching"
                )
            return self._free.popleft()

    def acquire_this(self, slot: int) -> bool:
        """Take slot `slot` if it is free -> whether it was."""
        with self._lock:
            if slot not in self._free:
                return False
            self._free.remove(slot)
            return True

    def release(self, slot: int) -> None:
        with self._lock:
            if not 0 <= slot < self.n or slot in self._free:
                raise RuntimeError(f"slot {slot} released but not held")
            self._free.append(slot)

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)
