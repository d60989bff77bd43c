"""CUDA graphs of a backend's forward at bucketed token counts.

Small batches are launch-bound: a graph replays the whole forward (routing,
both GEMMs, the norm and sum) as one launch. One set of static buffers per
bucket serves every layer (one forward runs at a time), and one memory pool
serves every graph. A call with M tokens runs the graph of the smallest bucket
>= M: rows past M have no routes (ids -1) and cost nothing.

Works with any backend that has `forward_into(state, x, ids, w, out)` and no
host sync or allocation inside it (the `cuda` backend).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def capturable(backend) -> bool:
    return backend.device.type == "cuda" and hasattr(backend, "forward_into")


@dataclass(slots=True)
class _Bucket:
    m: int
    x: torch.Tensor  # bf16 [m, H]
    ids: torch.Tensor  # int32 [m, K]
    weights: torch.Tensor  # fp32 [m, K]
    out: torch.Tensor  # bf16 [m, H]
    bad: torch.Tensor  # bool [m]: the row's inputs hold NaN/Inf (checked inside the graph)


class GraphBank:
    """Graphs for (layer, bucket); `run` replays one, or returns None to say 'run eager'."""

    def __init__(self, backend, hidden_size: int, top_k: int, buckets=DEFAULT_BUCKETS) -> None:
        self.backend = backend
        self.device = backend.device
        self.top_k = top_k
        self.buckets = sorted(buckets)
        self._pool = torch.cuda.graph_pool_handle()
        self._static = {
            m: _Bucket(
                m,
                torch.zeros((m, hidden_size), dtype=torch.bfloat16, device=self.device),
                torch.full((m, top_k), -1, dtype=torch.int32, device=self.device),
                torch.zeros((m, top_k), dtype=torch.float32, device=self.device),
                torch.zeros((m, hidden_size), dtype=torch.bfloat16, device=self.device),
                torch.zeros((m,), dtype=torch.bool, device=self.device),
            )
            for m in self.buckets
        }
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._keep: list[torch.Tensor] = []  # workspaces baked into graphs stay alive

    def capture(self, layer: int, state) -> None:
        """Capture every bucket of `layer` (outside any other capture; warms up first)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for m in self.buckets:
                b = self._static[m]
                self._keep.append(self.backend.reserve(state, self.buckets[-1], self.top_k))
                self._body(state, b)  # warm-up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                    self._body(state, b)
                self._graphs[(layer, m)] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _body(self, state, b: _Bucket) -> None:
        """What a replay runs: the forward, and the finite check of its inputs (one
        launch for all of it instead of a handful more after the replay)."""
        self.backend.forward_into(state, b.x, b.ids, b.weights, b.out)
        finite = torch.isfinite(b.x).all(dim=1) & torch.isfinite(b.weights).all(dim=1)
        torch.logical_not(finite, out=b.bad)

    def bucket_for(self, m: int, top_k: int) -> int | None:
        if top_k > self.top_k or m > self.buckets[-1]:
            return None
        return next(b for b in self.buckets if b >= m)

    def stage(self, layer: int, m: int, k: int):
        """Static input views (x [m, H], ids [m, k], weights [m, k]) of the graph that
        will run (layer, m, k), padding reset; None when no graph fits: run eager."""
        bucket = self.bucket_for(m, k) if m else None
        if bucket is None or (layer, bucket) not in self._graphs:
            return None
        b = self._static[bucket]
        b.ids.fill_(-1)  # rows and routes past the call's own: no route
        b.weights.zero_()
        return b.x[:m], b.ids[:m, :k], b.weights[:m, :k]

    def replay(self, layer: int, m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the graph `stage` prepared -> views (out [m, H], bad [m])."""
        bucket = self.bucket_for(m, k)
        self._graphs[(layer, bucket)].replay()
        b = self._static[bucket]
        return b.out[:m], b.bad[:m]
