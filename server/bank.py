"""The expert bank: every served layer's owned experts, prepared once by the
backend and kept resident, plus the shapes the service describes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from expertd.kernels.backend import Backend
from expertd.kernels.layer import ShardLayer
from expertd.kernels.lookup import create_backend, default_backend_name
from expertd.progress import Progress
from expertd.server.config import ServerConfig, parse_expert_list, shard_experts

log = logging.getLogger("expertd.server")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    hidden_size: int  # H
    intermediate_size: int  # I
    num_experts: int  # E
    top_k: int  # 0 when the source does not say
    layers: tuple[int, ...]
    experts: tuple[int, ...]  # owned global ids, ascending
    source: str


class WeightSource:
    """Uniform view over a checkpoint directory or a synthetic preset; opening it
    reads only headers, so the server knows its shapes before loading."""

    def __init__(self, config: ServerConfig) -> None:
        self.device = torch.device(config.device)
        if config.synthetic:
            from expertd.server.synthetic import get_preset

            self.preset = get_preset(config.synthetic)
            self.seed = config.seed
            self.reader = None
            p = self.preset
            self.shape = (p.hidden_size, p.intermediate_size, p.num_experts, p.top_k)
            self.layers = list(range(config.layers if config.layers is not None else 1))
        elif config.checkpoint:
            from expertd.server.checkpoint import CheckpointReader

            self.reader = CheckpointReader(config.checkpoint, prefix=config.prefix)
            r = self.reader
            log.info("checkpoint %s", r.description)
            self.shape = (r.hidden_size, r.intermediate_size, r.num_experts, r.top_k or 0)
            self.layers = list(r.layers)
            if config.layers is not None:
                self.layers = self.layers[: config.layers]
        else:
            raise ValueError("give a checkpoint directory or a synthetic preset")

    def load(self, layer: int, experts: list[int]) -> ShardLayer:
        if self.reader is not None:
            return self.reader.load_layer(layer, experts)
        from expertd.server.synthetic import synthetic_layer

        # Quantizing on the GPU is much faster; the result is the same tensors.
        return synthetic_layer(self.preset, self.seed, layer, experts, device=self.device)


class ExpertBank:
    """Owned experts of every served layer, resident on the backend's device."""

    def __init__(self, backend: Backend, info: ModelInfo, states: dict[int, Any]) -> None:
        self.backend = backend
        self.info = info
        self._states = states
        self.resident_bytes = sum(backend.resident_bytes(s) for s in states.values())

    @classmethod
    def load(
        cls,
        config: ServerConfig,
        progress: Callable[[str], None] | None = None,
        source: WeightSource | None = None,
    ) -> ExpertBank:
        device = torch.device(config.device)
        backend = create_backend(config.backend or default_backend_name(device), device)
        source = source or WeightSource(config)
        h, i, e, top_k = source.shape
        if config.experts is not None:
            experts = sorted(set(config.experts))
            if experts[0] < 0 or experts[-1] >= e:
                raise ValueError(f"--experts {experts[0]}..{experts[-1]} outside [0, {e})")
        else:
            experts = shard_experts(e, config.shard, config.num_shards)
        # Reading and the backend's repacking (NVFP4 layouts on a GPU), layer by layer:
        # a bar on a terminal, log lines otherwise (expertd/progress.py).
        bar = Progress(f"loading {backend.name} experts", len(source.layers), log=log)
        states: dict[int, Any] = {}
        loaded = 0
        start = time.perf_counter()
        for n, layer in enumerate(source.layers, 1):
            shard_layer = source.load(layer, experts)
            loaded += shard_layer.nbytes()
            states[layer] = backend.prepare(shard_layer)
            del shard_layer
            if progress is None:
                bar.update(
                    n, f"loaded layer {layer} ({len(experts)} experts, {loaded / 2**20:.1f} MiB)"
                )
                continue
            progress(
                f"loaded layer {layer} ({n}/{len(source.layers)}): {len(experts)} experts, "
                f"{loaded / 2**20:.1f} MiB, {time.perf_counter() - start:.1f} s"
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        bar.close()
        info = ModelInfo(h, i, e, top_k, tuple(source.layers), tuple(experts), config.source())
        return cls(backend, info, states)

    def has_layer(self, layer: int) -> bool:
        return layer in self._states

    def state(self, layer: int):
        """The backend's resident state of `layer`."""
        return self._states[layer]


__all__ = ["ExpertBank", "ModelInfo", "WeightSource", "parse_expert_list"]
