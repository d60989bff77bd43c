"""The interface between the server and the math: a Backend prepares a shard layer
once (repack, make resident) and runs the forward on it.

The server picks a backend by name (kernels/lookup.py) and never branches on which
one it got. Backend modules register themselves here when imported; this module
imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from expertd.kernels.layer import ShardLayer
from expertd.kernels.reference import dense_weights, moe_forward_dense


class Backend(Protocol):
    name: str
    device: torch.device

    def prepare(self, layer: ShardLayer) -> Any:
        """Checkpoint-form weights -> resident state on `device` (done once, at load)."""

    def forward(
        self,
        state: Any,
        x: torch.Tensor,  # bf16 [M, H] on device
        topk_ids: torch.Tensor,  # int32 [M, K] on device, global ids or -1
        topk_weights: torch.Tensor,  # float32 [M, K] on device
    ) -> torch.Tensor:
        """-> bf16 [M, H] on device: this shard's contribution."""

    def resident_bytes(self, state: Any) -> int:
        """Device memory the state holds."""


@dataclass(slots=True)
class _DenseState:
    w13: torch.Tensor  # float32 [El, 2I, H]
    w2: torch.Tensor  # float32 [El, H, I]
    norm_weight: torch.Tensor | None  # float32 [H]; None: no post-expert norm
    local_of: torch.Tensor  # int32 [E + 1]


class ReferenceBackend:
    """Plain torch on any device: weights dequantized once to float32, fp32 math."""

    name = "reference"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def prepare(self, layer: ShardLayer) -> _DenseState:
        w13, w2, norm = dense_weights(layer.to(self.device), torch.float32)
        return _DenseState(w13, w2, norm, layer.global_to_local(self.device))

    def forward(self, state: _DenseState, x, topk_ids, topk_weights) -> torch.Tensor:
        out = moe_forward_dense(
            state.w13, state.w2, state.norm_weight, state.local_of, x, topk_ids, topk_weights
        )
        return out.to(torch.bfloat16)

    def resident_bytes(self, state: _DenseState) -> int:
        tensors = (state.w13, state.w2, state.norm_weight)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


_FACTORIES: dict[str, Callable[[torch.device], Backend]] = {"reference": ReferenceBackend}


def register_backend(name: str, factory: Callable[[torch.device], Backend]) -> None:
    """Make backend `name` available; a backend module calls this when imported."""
    _FACTORIES[name] = factory


def registered() -> dict[str, Callable[[torch.device], Backend]]:
    """The backends registered so far, by name (see lookup.py for finding one by name)."""
    return dict(_FACTORIES)
