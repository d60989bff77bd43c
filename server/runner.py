"""Running one merged batch on the backend's device.

Several requests' host tensors go in; one bf16 [M, H] output and a per-row
"input was not finite" flag come out, both on the host. On CUDA the inputs are
gathered straight into pinned staging buffers (one copy from the received
bytes), moved with non-blocking copies, and the finite check runs on the device
and comes back with the output: no extra host pass, no extra sync.
"""

from __future__ import annotations

import logging
import time

import torch

from expertd.kernels.graphs import DEFAULT_BUCKETS, GraphBank, capturable
from expertd.server.bank import ExpertBank

log = logging.getLogger("expertd.server")


class BatchRunner:
    def __init__(self, bank: ExpertBank, graph_max_tokens: int = DEFAULT_BUCKETS[-1]) -> None:
        self.bank = bank
        self.device = bank.backend.device
        self._pinned: dict[str, torch.Tensor] = {}
        self.stage_ns = 0  # of the last run: gathering into host buffers
        self.graphs: GraphBank | None = None
        buckets = [b for b in DEFAULT_BUCKETS if b <= graph_max_tokens]
        if buckets and capturable(bank.backend):
            top_k = bank.info.top_k or 8
            self.graphs = GraphBank(bank.backend, bank.info.hidden_size, top_k, buckets)

    def warmup(self) -> None:
        """Before SERVING: capture the CUDA graphs (which also builds and loads the
        kernels), or run one tiny forward per layer on other backends."""
        start = time.perf_counter()
        h = self.bank.info.hidden_size
        for layer in self.bank.info.layers:
            if self.graphs is not None:
                self.graphs.capture(layer, self.bank.state(layer))
            else:
                x = torch.zeros((1, h), dtype=torch.bfloat16)
                self.run(
                    layer, [x], [torch.full((1, 1), -1, dtype=torch.int32)], [torch.zeros((1, 1))]
                )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info(
            "warm-up done in %.1f s%s",
            time.perf_counter() - start,
            f" ({len(self.bank.info.layers)} layers x buckets {self.graphs.buckets} captured)"
            if self.graphs
            else "",
        )

    def _buffer(self, name: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """A pinned host buffer of at least `shape`, grown on demand and reused."""
        need = shape[0] * shape[1]
        buf = self._pinned.get(name)
        if buf is None or buf.numel() < need or buf.dtype != dtype:
            buf = torch.empty(max(need, 1), dtype=dtype, pin_memory=True)
            self._pinned[name] = buf
        return buf[:need].view(shape)

    def _gather(self, xs, ids, ws, pinned: bool):
        """Concatenate the requests' rows; routes padded to the widest top_k (-1, weight 0)."""
        m = sum(x.shape[0] for x in xs)
        k = max(i.shape[1] for i in ids)
        h = xs[0].shape[1]
        if len(xs) == 1 and not pinned:
            return xs[0], ids[0].to(torch.int32), ws[0].to(torch.float32)
        if pinned:
            x = self._buffer("x", (m, h), torch.bfloat16)
            rid = self._buffer("ids", (m, k), torch.int32)
            rw = self._buffer("w", (m, k), torch.float32)
        else:
            x = torch.empty((m, h), dtype=torch.bfloat16)
            rid = torch.empty((m, k), dtype=torch.int32)
            rw = torch.empty((m, k), dtype=torch.float32)
        torch.cat(xs, out=x)
        rid.fill_(-1)
        rw.zero_()
        row = 0
        for i, w in zip(ids, ws, strict=True):
            rows, width = i.shape
            rid[row : row + rows, :width] = i
            rw[row : row + rows, :width] = w
            row += rows
        return x, rid, rw

    def run(self, layer: int, xs, ids, ws) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (out bf16 [M, H] on the host, bad bool [M]: row had NaN/Inf input).

        On CUDA the returned tensors are views of reused pinned buffers: read
        them before the next run."""
        state = self.bank.state(layer)
        backend = self.bank.backend
        start = time.perf_counter_ns()
        if self.device.type != "cuda":
            x, i, w = self._gather(xs, ids, ws, pinned=False)
            self.stage_ns = time.perf_counter_ns() - start
            bad = ~(torch.isfinite(x).all(dim=1) & torch.isfinite(w).all(dim=1))
            if x.shape[0] == 0:
                return torch.zeros((0, self.bank.info.hidden_size), dtype=torch.bfloat16), bad
            return backend.forward(state, x, i, w), bad
        x, i, w = self._gather(xs, ids, ws, pinned=True)
        self.stage_ns = time.perf_counter_ns() - start  # the rest is device work and its wait
        m, h = x.shape[0], self.bank.info.hidden_size
        out_host = self._buffer("out", (m, h), torch.bfloat16)
        bad_host = self._buffer("bad", (m, 1), torch.bool).view(m)
        if m == 0:
            return out_host, bad_host
        k = i.shape[1]
        staged = self.graphs.stage(layer, m, k) if self.graphs is not None else None
        if staged is not None:  # copy straight into the graph's static inputs, replay
            dx, di, dw = staged
            dx.copy_(x, non_blocking=True)
            di.copy_(i, non_blocking=True)
            dw.copy_(w, non_blocking=True)
            out, bad = self.graphs.replay(layer, m, k)
        else:
            dx = x.to(self.device, non_blocking=True)
            di = i.to(self.device, non_blocking=True)
            dw = w.to(self.device, non_blocking=True)
            out = backend.forward(state, dx, di, dw)
            bad = ~(torch.isfinite(dx).all(dim=1) & torch.isfinite(dw).all(dim=1))
        out_host.copy_(out, non_blocking=True)
        bad_host.copy_(bad, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return out_host, bad_host
