"""CPU checks of the CUDA backend's pieces that need no GPU: the repack's index math (through a
plain-torch twin of the kernel's in-register dequantization) and that the module imports."""

from __future__ import annotations

import importlib

import torch

from expertd.kernels.nvfp4 import Nvfp4Weight, quantize
from expertd.kernels.repack import (
    PackedProjection,
    emulate_dequant,
    interleave_gate_up,
    repack_down,
    repack_gate_up,
)

SHIFT = 2.0**7  # the kernel's dequantized bf16 is W / (weight_scale_2 * 2^7)


def _random_weight(el: int, n: int, k: int, seed: int, spread: float = 4.0) -> Nvfp4Weight:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn((el, n, k), generator=gen)
    mag = torch.exp(torch.empty((el, n, k // 16, 1)).uniform_(-spread, spread, generator=gen))
    return quantize((w.view(el, n, k // 16, 16) * mag).view(el, n, k))


def test_cuda_module_imports_without_gpu_or_nvcc():
    mod = importlib.import_module("expertd.kernels.cuda")
    assert hasattr(mod, "CudaBackend")


def test_repack_down_matches_dequantize():
    w = _random_weight(2, 48, 128, seed=1)
    packed = repack_down(w, chunk=1)
    assert isinstance(packed, PackedProjection)
    assert packed.codes.shape == (2, 3, 2, 32, 16) and packed.scales.shape == (2, 3, 2, 8, 4, 4)
    got = emulate_dequant(packed).double() * (w.weight_scale_2.double().view(-1, 1, 1) * SHIFT)
    torch.testing.assert_close(got, w.dequantize(torch.float64), rtol=0, atol=0)


def test_repack_gate_up_interleaves_rows_and_keeps_both_global_scales():
    gate = _random_weight(3, 32, 64, seed=2)
    up = _random_weight(3, 32, 64, seed=3, spread=1.0)
    assert not torch.equal(gate.weight_scale_2, up.weight_scale_2)
    packed = repack_gate_up(gate, up, chunk=2)
    dense = emulate_dequant(packed).double()  # [El, 2I, H] interleaved, unscaled
    sg = gate.weight_scale_2.double().view(-1, 1, 1) * SHIFT
    su = up.weight_scale_2.double().view(-1, 1, 1) * SHIFT
    rows = dense.view(3, 4, 2, 8, 64)  # [El, I/8, (gate, up), 8, H]
    torch.testing.assert_close(
        rows[:, :, 0].reshape(3, 32, 64) * sg, gate.dequantize(torch.float64)
    )
    torch.testing.assert_close(rows[:, :, 1].reshape(3, 32, 64) * su, up.dequantize(torch.float64))


def test_fp8_scales_over_their_whole_range_and_zero_blocks():
    # Every e4m3 bit pattern but NaN (0x7f) and zero blocks, with random codes (also in zero
    # blocks: the repack must zero them, since W is zero there).
    gen = torch.Generator().manual_seed(4)
    n, k = 16, 64 * 8
    codes = torch.randint(0, 256, (1, n, k // 2), generator=gen, dtype=torch.uint8)
    bits = torch.arange(n * k // 16, dtype=torch.int64) % 0x7F  # 0x00..0x7e
    scales = bits.to(torch.uint8).view(torch.float8_e4m3fn).view(1, n, k // 16)
    w = Nvfp4Weight(codes, scales, torch.tensor([0.37]))
    got = emulate_dequant(repack_down(w)).double() * (w.weight_scale_2.double() * SHIFT)
    torch.testing.assert_close(got, w.dequantize(torch.float64), rtol=1e-15, atol=0)


def test_interleave_gate_up_layout():
    gate = torch.arange(16).view(1, 16, 1)
    up = 100 + torch.arange(16).view(1, 16, 1)
    rows = interleave_gate_up(gate, up).flatten().tolist()
    assert rows[:16] == [*range(8), *range(100, 108)]
    assert rows[16:] == [*range(8, 16), *range(108, 116)]
