"""The NVFP4 codec against hand-computed values (docs/protocol.md)."""

from __future__ import annotations

import pytest
import torch

from expertd.kernels.nvfp4 import (
    E2M1_VALUES,
    Nvfp4Weight,
    dequantize,
    pack_codes,
    quantize,
    unpack_codes,
)


def fp8(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(torch.float8_e4m3fn)


def test_nibble_order_low_first():
    packed = torch.tensor([[0x21, 0xF8]], dtype=torch.uint8)
    assert unpack_codes(packed).tolist() == [[1, 2, 8, 15]]
    assert torch.equal(pack_codes(unpack_codes(packed)), packed)


def test_decode_hand_computed():
    # One row of 32 k: codes 0..15 then 15..0; two blocks with scales 2.0 and 0.25.
    codes = torch.tensor([list(range(16)) + list(range(15, -1, -1))], dtype=torch.uint8)
    scale = fp8([[2.0, 0.25]])
    w = dequantize(pack_codes(codes), scale, torch.tensor(0.5), torch.float64)
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    first = [v * 2.0 * 0.5 for v in magnitudes] + [-v * 2.0 * 0.5 for v in magnitudes]
    # second block: codes 15..0 -> values -6, -4, ..., -0, 6, ..., 0 times 0.25 * 0.5
    expected = first + [
        (-magnitudes[c - 8] if c >= 8 else magnitudes[c]) * 0.25 * 0.5 for c in range(15, -1, -1)
    ]
    assert w.tolist() == [expected]
    assert w[0, 15].item() == -6.0 and w[0, 16].item() == -0.75


def test_sign_bit_and_negative_zero():
    w = dequantize(
        pack_codes(torch.tensor([[8] * 16], dtype=torch.uint8)), fp8([[1.0]]), torch.tensor(1.0)
    )
    assert (w == 0).all()


def test_stacked_experts_with_own_global_scales():
    codes = torch.full((2, 1, 16), 7, dtype=torch.uint8)  # +6 everywhere
    w = dequantize(pack_codes(codes), fp8([[[1.0]], [[1.0]]]), torch.tensor([1.0, 3.0]))
    assert w[0].unique().tolist() == [6.0] and w[1].unique().tolist() == [18.0]


def test_quantize_exact_on_representable_values():
    # Every block holds a 6 (so its scale is exactly amax / 6) and E2M1 values only.
    values = torch.tensor(E2M1_VALUES)
    row = torch.cat([values, -values]) * torch.tensor(2.0)
    row[0] = 12.0
    w = torch.stack([row, row * 0.5])
    q = quantize(w)
    # The codes are exactly the grid points; the values only up to the rounding
    # of the global scale (amax / (448 * 6) is not a power of two).
    # row / 2 = [6, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, ...]: codes 7, 1, 2, ..., 0 (a zero has no sign), 9, ...
    assert unpack_codes(q.weight)[0].tolist() == [
        7,
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        0,
        9,
        10,
        11,
        12,
        13,
        14,
        15,
    ]
    torch.testing.assert_close(q.dequantize(), w, rtol=1e-6, atol=0)
    assert q.weight.shape == (2, 8) and q.weight_scale.shape == (2, 1)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 50.0])
def test_quantize_error_is_bounded(scale):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn((64, 256), generator=gen) * scale
    q = quantize(w)
    assert isinstance(q, Nvfp4Weight) and q.weight.dtype == torch.uint8
    assert q.weight_scale.dtype == torch.float8_e4m3fn and q.weight_scale_2.dtype == torch.float32
    err = (q.dequantize() - w).norm() / w.norm()
    assert err < 0.12  # 4-bit values with fp8 block scales: ~8-10% for Gaussian data
    # Rounding picks the nearest grid value: no element is off by more than half
    # its block's largest step (2 * fp8 scale * global scale).
    step = q.weight_scale.float().repeat_interleave(16, dim=1) * q.weight_scale_2
    assert ((q.dequantize() - w).abs() <= step * 1.0 + 1e-12).all()


def test_quantize_all_zero_and_tiny_blocks():
    w = torch.zeros((2, 32))
    w[1, 16:] = 1e-30  # underflows the fp8 scale: must come back as zeros, not NaN
    q = quantize(w)
    assert torch.isfinite(q.dequantize()).all()
    assert (q.dequantize()[0] == 0).all()


def test_shape_errors_are_named():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize(torch.zeros(2, 24))
    with pytest.raises(ValueError, match="weight_scale shape"):
        dequantize(torch.zeros((2, 8), dtype=torch.uint8), fp8([[1.0, 1.0]]), torch.tensor(1.0))
