"""NVFP4 (ModelOpt) weight codec: the checkpoint form of docs/protocol.md, in plain torch.

A projection W of shape [N, K] is stored as

    weight          uint8          [N, K/2]   two E2M1 codes per byte (low nibble = even k)
    weight_scale    float8_e4m3fn  [N, K/16]  one scale per 16 consecutive k
    weight_scale_2  float32        []         the projection's global scale

    W[n, k] = e2m1(code[n, k]) * float(weight_scale[n, k // 16]) * weight_scale_2

E2M1 code c: bit 3 is the sign, bits 0-2 index E2M1_VALUES. Every function here
also takes leading batch dimensions (e.g. [E, N, K/2] for a stack of experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16  # k-elements per fp8 scale
FP8_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True, slots=True)
class Nvfp4Weight:
    """One projection (or a stack of them along leading dims) in checkpoint form."""

    weight: torch.Tensor  # uint8 [..., N, K/2]
    weight_scale: torch.Tensor  # float8_e4m3fn [..., N, K/16]
    weight_scale_2: torch.Tensor  # float32 [...]

    @property
    def n(self) -> int:
        return self.weight.shape[-2]

    @property
    def k(self) -> int:
        return self.weight.shape[-1] * 2

    def to(self, device: torch.device | str) -> Nvfp4Weight:
        return Nvfp4Weight(
            self.weight.to(device),
            self.weight_scale.to(device),
            self.weight_scale_2.to(device),
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.weight_scale_2, dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.weight_scale))


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, K/2] -> uint8 codes [..., N, K] (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed E2M1 codes must be uint8, got {packed.dtype}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., N, K] (values 0..15) -> uint8 [..., N, K/2]."""
    if codes.shape[-1] % 2:
        raise ValueError(f"K must be even to pack E2M1 codes, got {codes.shape[-1]}")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def e2m1_to_float(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) -> their values."""
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=codes.device)
    magnitude = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -magnitude, magnitude)


def dequantize(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Checkpoint tensors -> W [..., N, K] in `dtype` (float32 or float64 for exact values)."""
    n, half_k = weight.shape[-2:]
    k = half_k * 2
    if weight_scale.shape[-2:] != (n, k // BLOCK):
        raise ValueError(
            f"weight_scale shape {tuple(weight_scale.shape)} does not match weight "
            f"{tuple(weight.shape)}: expected [..., {n}, {k // BLOCK}]"
        )
    values = e2m1_to_float(unpack_codes(weight), dtype)  # [..., N, K]
    scales = weight_scale.to(dtype).repeat_interleave(BLOCK, dim=-1)  # [..., N, K]
    global_scale = weight_scale_2.to(dtype).reshape(*weight_scale_2.shape, 1, 1)
    return values * scales * global_scale


def quantize(w: torch.Tensor) -> Nvfp4Weight:
    """Float W [..., N, K] -> NVFP4 checkpoint form (round to nearest E2M1).

    The global scale maps the tensor's max magnitude onto the largest product of
    an fp8 scale and an E2M1 value (448 * 6); each 16-block's fp8 scale is its
    max magnitude over 6, so the block's largest element lands on +-6.
    """
    if w.shape[-1] % BLOCK:
        raise ValueError(f"K must be a multiple of {BLOCK}, got {w.shape[-1]}")
    w = w.float()
    lead = w.shape[:-2]
    amax = w.abs().amax(dim=(-2, -1))  # [...]
    scale_2 = torch.where(amax > 0, amax / (FP8_MAX * E2M1_MAX), torch.ones_like(amax))
    blocks = w.unflatten(-1, (-1, BLOCK))  # [..., N, K/16, 16]
    block_amax = blocks.abs().amax(dim=-1)  # [..., N, K/16]
    block_scale = block_amax / E2M1_MAX / scale_2.reshape(*lead, 1, 1)
    scale_fp8 = block_scale.clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    step = scale_fp8.float() * scale_2.reshape(*lead, 1, 1)  # [..., N, K/16]
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.where(step.unsqueeze(-1) > 0, blocks / safe.unsqueeze(-1), torch.zeros_like(blocks))
    index = _nearest_e2m1_index(q.abs().clamp(max=E2M1_MAX))
    codes = index | ((q < 0).to(torch.uint8) << 3)
    return Nvfp4Weight(pack_codes(codes.flatten(-2)), scale_fp8, scale_2.float())


def _nearest_e2m1_index(a: torch.Tensor) -> torch.Tensor:
    """Magnitudes in [0, 6] -> index of the nearest E2M1 value (uint8 0..7).

    The index is the number of midpoints between neighbouring values that `a`
    exceeds (a tie rounds down, which is still a nearest value).
    """
    index = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for midpoint in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        index += a > midpoint
    return index
