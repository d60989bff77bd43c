"""Synthetic NVFP4 checkpoints: presets and deterministic weights.

Every tensor is drawn from its own generator seeded by (seed, layer, expert,
projection), so a shard can generate only its own experts and get exactly the
tensors `expertd make-checkpoint` writes for them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from expertd.kernels.layer import ShardLayer
from expertd.kernels.nvfp4 import Nvfp4Weight, quantize


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    hidden_size: int  # H
    intermediate_size: int  # I
    num_experts: int  # E
    top_k: int
    post_norm: bool = False  # the layer ends with muse-spark's post-expert RMS norm


PRESETS = {
    # Fast on two CPU cores, and legal for the GPU kernel (H, I multiples of 256).
    "small": Preset("small", 512, 256, 64, 8, post_norm=True),
    "muse-spark": Preset("muse-spark", 4096, 4096, 256, 8, post_norm=True),
    # The routed experts of released families (server/families.py, docs/models.md): the
    # shapes of their config.json, no post-expert norm.
    "deepseek-v3": Preset("deepseek-v3", 7168, 2048, 256, 8),  # also DeepSeek-R1
    "qwen3-235b-a22b": Preset("qwen3-235b-a22b", 4096, 1536, 128, 8),
    "qwen3-30b-a3b": Preset("qwen3-30b-a3b", 2048, 768, 128, 8),
    # Llama-4: one expert per token, its input scaled by the router (docs/models.md)
    "llama4-scout": Preset("llama4-scout", 5120, 8192, 16, 1),
    "llama4-maverick": Preset("llama4-maverick", 5120, 8192, 128, 1),
}

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None


def _generator(seed: int, *path: object) -> torch.Generator:
    digest = hashlib.blake2b("/".join(map(str, (seed, *path))).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def expert_projection(
    preset: Preset,
    seed: int,
    layer: int,
    expert: int,
    proj: str,
    device: torch.device | str = "cpu",
) -> Nvfp4Weight:
    """One projection of one expert, quantized: [N, K] with (N, K) = (I, H) or (H, I).

    The float weights are always drawn on the CPU (so they do not depend on the
    device); the quantization, exact IEEE arithmetic, may run on `device`.
    """
    h, i = preset.hidden_size, preset.intermediate_size
    n, k = (h, i) if proj == "down_proj" else (i, h)
    gen = _generator(seed, layer, expert, proj)
    # Gaussian weights with a spread of per-16-block magnitudes (so the fp8 scales
    # span a range) and a different overall size per projection (so gate and up
    # get different global scales).
    gain = {"gate_proj": 1.0, "up_proj": 2.5, "down_proj": 1.0}[proj] / k**0.5
    w = torch.randn((n, k), generator=gen)
    spread = torch.exp(torch.empty((n, k // 16, 1)).uniform_(-2.0, 2.0, generator=gen))
    w = (w.view(n, k // 16, 16) * spread).view(n, k) * gain
    return quantize(w.to(device))


def norm_weight(preset: Preset, seed: int, layer: int) -> torch.Tensor:
    gen = _generator(seed, layer, "post_expert_norm")
    return (torch.randn(preset.hidden_size, generator=gen) * 0.1).to(torch.bfloat16)


def synthetic_layer(
    preset: Preset, seed: int, layer: int, experts: list[int], device: torch.device | str = "cpu"
) -> ShardLayer:
    """The owned experts of one synthetic layer, stacked in the given order, on `device`."""
    stacks = {}
    for proj in PROJECTIONS:
        parts = [expert_projection(preset, seed, layer, e, proj, device) for e in experts]
        stacks[proj] = Nvfp4Weight(
            torch.stack([p.weight for p in parts]),
            torch.stack([p.weight_scale for p in parts]),
            torch.stack([p.weight_scale_2 for p in parts]),
        )
    return ShardLayer(
        experts=tuple(experts),
        num_experts=preset.num_experts,
        gate=stacks["gate_proj"],
        up=stacks["up_proj"],
        down=stacks["down_proj"],
        norm_weight=norm_weight(preset, seed, layer).to(device) if preset.post_norm else None,
    )
