"""The client with CUDA tensors in and out (pinned staging) against shard servers
on the GPU, through the drop-in RemoteExperts module. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from expertd.client import ExpertClient, RemoteExperts
from expertd.kernels import reference_forward, relative_error
from expertd.server.app import BackgroundServer
from expertd.server.config import ServerConfig
from expertd.server.synthetic import get_preset, synthetic_layer

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def test_cuda_tensors_through_two_gpu_shards():
    preset = get_preset("small")
    configs = [
        ServerConfig(synthetic="small", layers=1, seed=9, shard=s, num_shards=2, device="cuda")
        for s in range(2)
    ]
    servers = [BackgroundServer(c) for c in configs]
    try:
        full = synthetic_layer(preset, 9, 0, list(range(preset.num_experts)), device="cuda")
        with ExpertClient([s.address for s in servers]) as client:
            experts = RemoteExperts(client, 0)
            gen = torch.Generator(device="cuda").manual_seed(0)
            for m in (1, 33, 700):
                x = torch.randn((m, preset.hidden_size), device="cuda", generator=gen).bfloat16()
                logits = torch.randn((m, preset.num_experts), device="cuda", generator=gen)
                top = logits.topk(preset.top_k, dim=1)
                ids, w = top.indices.int(), torch.softmax(top.values, dim=1)
                out = experts(x, ids, w)
                assert out.device.type == "cuda" and out.dtype == torch.bfloat16
                err = relative_error(out, reference_forward(full, x, ids, w))
                print(f"client cuda M={m}: rel err {err:.2e}")
                assert err <= 1e-2
    finally:
        for s in servers:
            s.stop()
