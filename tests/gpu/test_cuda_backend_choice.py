"""Which backend a GPU gets by default, and why, on the GPU at hand: the compiled kernels on
compute capability 9.0 (with a library or nvcc), the reference elsewhere, with the reason."""

from __future__ import annotations

import pytest
import torch

from expertd.kernels import build, lookup

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_default_backend_follows_the_compute_capability():
    device = torch.device("cuda", 0)
    cap = tuple(torch.cuda.get_device_capability(device))
    name, why = lookup.choose_backend(device)
    if cap != build.TARGET_CAPABILITY:
        assert name == "reference" and f"compute capability {cap[0]}.{cap[1]}" in why
        with pytest.raises(ValueError, match=r"backend cuda: .*sm_90a"):
            lookup.create_backend("cuda", device)
    elif lookup._no_library() is None:
        assert name == "cuda" and torch.cuda.get_device_name(device) in why
        assert lookup.create_backend("cuda", device).name == "cuda"
    else:
        assert name == "reference" and "nvcc" in why
