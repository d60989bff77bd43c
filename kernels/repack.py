"""Repack at load: checkpoint NVFP4 -> the CUDA kernels' resident layout (kernels/csrc/moe_nvfp4.cu).

Plain torch, runs on whatever device the weights are on (seconds per layer on the GPU).

Shape legend:
    El  local experts     N  output rows of a projection     K  reduction length
    Mt  m-tiles = N / 16  Kg 64-k groups = K / 64            g, t: lane / 4, lane % 4

Resident form of one projection stack [El, N, K]:
    codes   uint8 [El, Mt, Kg, 32 lanes, 16 B]: lane (g, t) holds, for each k-step ks of the
            group, the 32-bit word ks with the 8 codes of its m16n8k16 A fragment: value (reg, h)
            is (row, k) = (g + 8 (reg % 2), 2t + h + 8 (reg // 2)) within the m-tile / k-step;
            its 4 code bits sit where e2m1_regs (the kernel's e2m1x8_to_bf16x8) takes them from.
    scales  bf16 bits, uint8 [El, Mt, Kg, 8 g, 4 ks, 2 rows, 2 B]: fp8 scale * 2^119 (exact) of
            rows g and g+8 for k-step ks.
Gate and up are interleaved first: m-tile m = gate rows 8m..8m+7 then up rows 8m..8m+7.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from expertd.kernels.nvfp4 import Nvfp4Weight, unpack_codes

# E2M1 -> bf16 by moving bits: output register reg of a code word q holds two values, each with
# its sign at bf16 bit 15 and its 3 magnitude bits at 6-8 (exponent LSBs + mantissa MSB): value *
# 2^-126 exactly. 8 ops for 4 registers (the fewest a search over masks, shifts, rotations,
# byte permutes and carry-free multiplies found): a mask, two rotations then a mask each, and
# one carry-free multiply of a masked word making three copies, (x & M) * (2^2 + 2^7 + 2^12),
# then a mask (earlier layouts took 10 and 11 ops). The kernel (e2m1x8_to_bf16x8, moe_nvfp4.cu) does the same
# operations; the repack puts each code bit where they take it from (_code_bit_positions).
_P = 0x81C081C0  # bf16 bits 15, 8, 7, 6 of both halves
_M32 = 0xFFFFFFFF


def _rotl(x, s: int):
    return ((x << s) | (x >> (32 - s))) & _M32


def e2m1_regs(q):
    """The kernel's 4 output registers of code word q (int or int64 tensor, 32 bits used)."""
    return (
        q & _P,
        _rotl(q, 10) & _P,
        _rotl(q, 13) & _P,
        (((q & 0x001B001B) * 4228) & _M32) & _P,
    )


@cache
def _code_bit_positions() -> tuple[tuple[tuple[int, ...], ...], ...]:
    """[reg][h][code bit b] -> the bit of q that e2m1_regs moves to that value's bf16 bit for
    code bit b (0: mantissa -> 6, 1, 2: exponent -> 7, 8, 3: sign -> 15; + 16 h). Found by
    sending each single bit of q through e2m1_regs; every (reg, bf16 bit) gets exactly one."""
    src: dict[tuple[int, int], int] = {}
    for j in range(32):
        for reg, out in enumerate(e2m1_regs(1 << j)):
            if out:
                if out & (out - 1) or (reg, out.bit_length() - 1) in src:
                    raise AssertionError(f"q bit {j} is not a clean move")
                src[(reg, out.bit_length() - 1)] = j
    dst = (6, 7, 8, 15)
    return tuple(
        tuple(tuple(src[(reg, d + 16 * h)] for d in dst) for h in range(2)) for reg in range(4)
    )


SCALE_SHIFT = 119  # resident bf16 scale = fp8 * 2^119; the kernel's product is W / (gs * 2^7)


@dataclass(frozen=True, slots=True)
class PackedProjection:
    codes: torch.Tensor  # uint8 [El, Mt, Kg, 32, 16]
    scales: torch.Tensor  # uint8 [El, Mt, Kg, 8 g, 4 ks, 2 rows x 2 B]: bf16 bits

    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel()


def _value_coords() -> tuple[torch.Tensor, torch.Tensor]:
    """(row, k) within an m-tile x k-step of value (lane, reg, h): two int64 [32, 4, 2]."""
    lane = torch.arange(32).view(32, 1, 1)
    reg = torch.arange(4).view(1, 4, 1)
    h = torch.arange(2).view(1, 1, 2)
    g, t = lane // 4, lane % 4
    row = (g + 8 * (reg % 2)).expand(32, 4, 2)
    return row, 2 * t + h + 8 * (reg // 2)


def code_gather_index(device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [32 lanes, 4 ks, 4 regs, 2 h]: flat index row * 64 + k into a 16 x 64 (m-tile, k-group)."""
    row, k = _value_coords()  # [32, 4 reg, 2 h]
    ks = torch.arange(4).view(1, 4, 1, 1)
    return (row.unsqueeze(1) * 64 + ks * 16 + k.unsqueeze(1)).to(device)


def scale_gather_index(device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [8 g, 4 ks, 2]: flat index row * 4 + ks into a 16 x 4 block of scales."""
    g = torch.arange(8).view(8, 1, 1)
    ks = torch.arange(4).view(1, 4, 1)
    half = torch.arange(2).view(1, 1, 2)
    return ((g + 8 * half) * 4 + ks).to(device)


def _bit_positions(device) -> torch.Tensor:
    """int64 [4 reg, 2 h, 4 code bits]: where each code bit of value (reg, h) goes in the word."""
    return torch.tensor(_code_bit_positions(), dtype=torch.int64, device=device)


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
    dev = codes.device
    tiles = codes.view(el, mt, 16, kg, 64).permute(0, 1, 3, 2, 4).reshape(el, mt, kg, 1024)
    vals = tiles[..., code_gather_index(dev).view(-1)].view(el, mt, kg, 32, 4, 4, 2).long()
    pos = _bit_positions(dev)  # [4 reg, 2 h, 4 code bits]
    cb = torch.arange(4, device=dev)
    bits = ((vals.unsqueeze(-1) >> cb) & 1) << pos  # [..., 4 reg, 2 h, 4]: disjoint single bits
    words = bits.sum(dim=(-3, -2, -1))  # [El, Mt, Kg, 32, 4 ks]
    shifts = torch.arange(4, device=dev) * 8
    packed = ((words.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8).view(el, mt, kg, 32, 16)
    st = scales_u8.view(el, mt, 16, kg, 4).permute(0, 1, 3, 2, 4).reshape(el, mt, kg, 64)
    sp = st[..., scale_gather_index(dev).view(-1)].view(el, mt, kg, 8, 4, 2)
    sbf = (sp.view(torch.float8_e4m3fn).float() * 2.0**SCALE_SHIFT).to(torch.bfloat16)
    return PackedProjection(packed.contiguous(), sbf.contiguous().view(torch.uint8))


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
    """Resident form -> float32 [El, N, K] = E2M1 * fp8 * 2^-7 (the kernel's bf16 A operand),
    through the kernel's own bit operations (e2m1x8_to_bf16x8, the halves of the scale word)."""
    el, mt, kg = p.codes.shape[:3]
    words = p.codes.view(el, mt, kg, 32, 4, 4).to(torch.int64)
    words = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24
    scale = _bf16_from_bits(
        p.scales.view(el, mt, kg, 8, 4, 2, 2).to(torch.int64).select(-1, 0)
        | p.scales.view(el, mt, kg, 8, 4, 2, 2).to(torch.int64).select(-1, 1) << 8
    )  # [el, mt, kg, g, ks, half]
    lane = torch.arange(32)
    g = lane // 4
    row, kk = _value_coords()  # [32, 4 reg, 2 h]
    out = torch.zeros((el, mt, kg, 16, 64), dtype=torch.float32)
    for ks in range(4):
        q = words[..., ks]  # [el, mt, kg, 32]
        regs = e2m1_regs(q)
        for reg in range(4):
            for h in range(2):
                v = _bf16_from_bits((regs[reg] >> (16 * h)) & 0xFFFF)  # E2M1 * 2^-126
                s = scale[..., g, ks, reg % 2]  # rows g (even regs) or g+8 (odd regs)
                prod = (v.double() * s.double()).float()  # exact: <= 6 significant bits
                out[..., row[:, reg, h], ks * 16 + kk[:, reg, h]] = prod
    return out.permute(0, 1, 3, 2, 4).reshape(el, mt * 16, kg * 64)
