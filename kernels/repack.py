"""Repack at load: checkpoint NVFP4 -> the CUDA kernels' resident layout (kernels/csrc/moe_nvfp4.cu).

Plain torch, runs on whatever device the weights are on (seconds per layer on the GPU).

Shape legend:
    El  local experts     N  output rows of a projection     K  reduction length
    Mt  m-tiles = N / 16  Kg 64-k groups = K / 64            g, t: lane / 4, lane % 4

Resident form of one projection stack [El, N, K]:
    codes   uint8 [El, Mt, Kg, 32 lanes, 16 B]: lane (g, t) holds, for k-step ks of the group,
            the 32-bit word ks whose nibble n is the code of (row, k) = NIBBLE_SOURCE[n]
            (rows within the m-tile, k within the k-step), exactly the m16n8k16 A-fragment order.
    scales  uint8 [El, Mt, Kg, 8 g, 4 ks, 2]: fp8 e4m3 bits of rows g and g+8 for k-step ks.
Gate and up are interleaved first: m-tile m = gate rows 8m..8m+7 then up rows 8m..8m+7.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertd.kernels.nvfp4 import Nvfp4Weight, unpack_codes

# Nibble n (bits 4n..4n+3) of lane (g, t)'s word for one k-step: (row offset, k offset).
# row offset is added to g, k offset to 2t. See the header of moe_nvfp4.cu.
NIBBLE_SOURCE = (
    (8, 8),  # 0: a6  row g+8, k 2t+8
    (0, 8),  # 1: a4  row g,   k 2t+8
    (8, 0),  # 2: a2  row g+8, k 2t
    (0, 0),  # 3: a0  row g,   k 2t
    (8, 9),  # 4: a7  row g+8, k 2t+9
    (0, 9),  # 5: a5  row g,   k 2t+9
    (8, 1),  # 6: a3  row g+8, k 2t+1
    (0, 1),  # 7: a1  row g,   k 2t+1
)


@dataclass(frozen=True, slots=True)
class PackedProjection:
    codes: torch.Tensor  # uint8 [El, Mt, Kg, 32, 16]
    scales: torch.Tensor  # uint8 [El, Mt, Kg, 8, 4, 2]

    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel()


def code_gather_index(device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [32 lanes, 4 ks, 8 nibbles]: flat index row * 64 + k into a 16 x 64 (m-tile, k-group)."""
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    idx = torch.empty((32, 4, 8), dtype=torch.int64)
    for ks in range(4):
        for n, (dr, dk) in enumerate(NIBBLE_SOURCE):
            idx[:, ks, n] = (g + dr) * 64 + ks * 16 + 2 * t + dk
    return idx.to(device)


def scale_gather_index(device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [8 g, 4 ks, 2]: flat index row * 4 + ks into a 16 x 4 block of scales."""
    g = torch.arange(8).view(8, 1, 1)
    ks = torch.arange(4).view(1, 4, 1)
    half = torch.arange(2).view(1, 1, 2)
    return ((g + 8 * half) * 4 + ks).to(device)


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[El, I, X] x2 -> [El, 2I, X]: rows 16m..16m+7 = gate 8m.., rows 16m+8.. = up 8m.."""
    el, i = gate.shape[:2]
    rest = gate.shape[2:]
    g = gate.reshape(el, i // 8, 8, *rest)
    u = up.reshape(el, i // 8, 8, *rest)
    return torch.cat((g, u), dim=2).reshape(el, 2 * i, *rest)


def pack_codes_scales(codes: torch.Tensor, scales_u8: torch.Tensor) -> PackedProjection:
    """codes uint8 [El, N, K] (one code per byte), fp8 bits uint8 [El, N, K/16] -> resident."""
    el, n, k = codes.shape
    if n % 16 or k % 64:
        raise ValueError(f"N must be a multiple of 16 and K of 64, got N={n}, K={k}")
    mt, kg = n // 16, k // 64
    # A zero scale means a zero block: zero its codes so the kernel's scale conversion (which
    # maps fp8 0 to a finite non-zero bf16) never matters.
    zero = (scales_u8 & 0x7F) == 0  # [El, N, K/16]
    codes = codes.masked_fill(zero.repeat_interleave(16, dim=-1), 0)
    tiles = codes.view(el, mt, 16, kg, 64).permute(0, 1, 3, 2, 4).reshape(el, mt, kg, 1024)
    nib = tiles[..., code_gather_index(codes.device).view(-1)].view(el, mt, kg, 32, 16, 2)
    packed = (nib[..., 0] | (nib[..., 1] << 4)).contiguous()  # [El, Mt, Kg, 32, 16]
    st = scales_u8.view(el, mt, 16, kg, 4).permute(0, 1, 3, 2, 4).reshape(el, mt, kg, 64)
    sp = st[..., scale_gather_index(codes.device).view(-1)].view(el, mt, kg, 8, 4, 2)
    return PackedProjection(packed, sp.contiguous())


def _fp8_bits(w: Nvfp4Weight) -> torch.Tensor:
    return w.weight_scale.view(torch.uint8)


def repack_gate_up(gate: Nvfp4Weight, up: Nvfp4Weight, chunk: int = 4) -> PackedProjection:
    """Gate and up [El, I, H/2] -> one interleaved resident stack (2I rows), `chunk` experts at a time."""
    parts = []
    for s in range(0, gate.weight.shape[0], chunk):
        sl = slice(s, s + chunk)
        codes = interleave_gate_up(unpack_codes(gate.weight[sl]), unpack_codes(up.weight[sl]))
        scales = interleave_gate_up(_fp8_bits(gate)[sl], _fp8_bits(up)[sl])
        parts.append(pack_codes_scales(codes, scales))
    return PackedProjection(
        torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts])
    )


def repack_down(down: Nvfp4Weight, chunk: int = 4) -> PackedProjection:
    parts = []
    for s in range(0, down.weight.shape[0], chunk):
        sl = slice(s, s + chunk)
        parts.append(pack_codes_scales(unpack_codes(down.weight[sl]), _fp8_bits(down)[sl]))
    return PackedProjection(
        torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts])
    )


# ------------------------------------------------------------------------------------------
# A plain-torch twin of the kernel's in-register dequantization, for CPU tests: it reads the
# resident form with the same bit operations the kernel uses and returns the dense matrix.


def _bf16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return (bits.to(torch.int32) << 16).view(torch.float32)


def emulate_dequant(p: PackedProjection) -> torch.Tensor:
    """Resident form -> float32 [El, N, K] = E2M1 * fp8 * 2^-7 (the kernel's bf16 A operand)."""
    el, mt, kg = p.codes.shape[:3]
    words = p.codes.view(el, mt, kg, 32, 4, 4).to(torch.int64)
    words = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24
    sc = p.scales.view(el, mt, kg, 8, 4, 2).to(torch.int64)  # [.., g, ks, half]
    lane = torch.arange(32)
    g = lane // 4
    # scale as the kernel converts it: fp8 -> f16 exact, then exponent + 231 as bf16 (= fp8*2^119)
    fp8 = sc.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    scale = fp8 * 2.0**119  # [el, mt, kg, 8, 4, 2]
    out = torch.zeros((el, mt, kg, 16, 64), dtype=torch.float32)
    for ks in range(4):
        w = words[..., ks]  # [el, mt, kg, 32]
        for i in range(4):  # A register i = f(w << 4i), halves lo/hi
            x = (w << (4 * i)) & 0xFFFFFFFF
            bits = (x & 0x80008000) | ((x >> 6) & 0x01C001C0)
            for half, n in ((0, 3 - i), (1, 7 - i)):
                v = _bf16_from_bits((bits >> (16 * half)) & 0xFFFF)  # E2M1 * 2^-126
                dr, dk = NIBBLE_SOURCE[n]
                s = scale[..., g, ks, dr // 8]  # [el, mt, kg, 32]
                prod = (v.double() * s.double()).float()  # exact: <= 6 significant bits
                rows = g + dr
                cols = ks * 16 + 2 * (lane % 4) + dk
                out[..., rows, cols] = prod
    return out.permute(0, 1, 3, 2, 4).reshape(el, mt * 16, kg * 64)
