"""The weights one shard holds for one layer, in checkpoint (NVFP4) form."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertd.kernels.nvfp4 import Nvfp4Weight


@dataclass(frozen=True, slots=True)
class ShardLayer:
    """Owned experts of one MoE layer, stacked in local order.

    El = number of owned experts, H = hidden width, I = expert intermediate width.
    """

    experts: tuple[int, ...]  # global expert id of each local slot, len El
    num_experts: int  # E: experts in the whole layer (ids are in [0, E))
    gate: Nvfp4Weight  # [El, I, H/2] codes, [El, I, H/16] scales, [El] global scales
    up: Nvfp4Weight  # [El, I, H/2], ...
    down: Nvfp4Weight  # [El, H, I/2], ...
    # bf16 [H]: the post-expert RMS norm multiplies by (1 + norm_weight) (muse-spark);
    # None: the layer has no post-expert norm (Qwen3-MoE, DeepSeek-V3, Mixtral).
    norm_weight: torch.Tensor | None

    def __post_init__(self) -> None:
        el, i, h = len(self.experts), self.intermediate_size, self.hidden_size
        for name, proj, shape in (
            ("gate", self.gate, (el, i, h)),
            ("up", self.up, (el, i, h)),
            ("down", self.down, (el, h, i)),
        ):
            got = (proj.weight.shape[0], proj.n, proj.k)
            if proj.weight.dim() != 3 or got != shape:
                raise ValueError(f"{name}: weights of shape {got}, expected {shape}")
        if self.norm_weight is not None and tuple(self.norm_weight.shape) != (h,):
            raise ValueError(f"norm_weight: shape {tuple(self.norm_weight.shape)}, expected ({h},)")
        if len(set(self.experts)) != el or any(not 0 <= e < self.num_experts for e in self.experts):
            raise ValueError(
                f"experts {self.experts} must be distinct ids in [0, {self.num_experts})"
            )

    @property
    def hidden_size(self) -> int:
        return self.down.n

    @property
    def intermediate_size(self) -> int:
        return self.gate.n

    @property
    def num_local_experts(self) -> int:
        return len(self.experts)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in (self.gate, self.up, self.down))

    def to(self, device: torch.device | str) -> ShardLayer:
        return ShardLayer(
            self.experts,
            self.num_experts,
            self.gate.to(device),
            self.up.to(device),
            self.down.to(device),
            None if self.norm_weight is None else self.norm_weight.to(device),
        )

    def global_to_local(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """int32 [E + 1]: local slot of each global id, -1 if not owned; index E maps id -1."""
        table = torch.full((self.num_experts + 1,), -1, dtype=torch.int32)
        for slot, e in enumerate(self.experts):
            table[e] = slot
        return table.to(device)
