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


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_routes_on_the_gpu_stage_as_the_torch_casts_would(id_dtype, w_dtype):
    """A CUDA caller's routes staged to the host are the values torch's casts give,
    contiguous or not, and they, and x, are the ones the caller's current stream wrote
    last (staging waits for it: cuda-ipc slots then read x on their own streams)."""
    from expertd.client.core import stage_inputs
    from expertd.client.routing import Topology

    topo = Topology(hidden_size=64, intermediate_size=128, num_experts=256, top_k=8, shards=())
    gen = torch.Generator(device="cuda").manual_seed(1)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for m in (1, 7, 300):
            x = torch.randn((m, 64), device="cuda", generator=gen)  # float32: cast on the GPU
            ids = torch.randint(0, 256, (m, 8), device="cuda", generator=gen).to(id_dtype)
            torch.cuda._sleep(1_000_000)  # the routes' last writes queue behind a busy stream
            w = (torch.rand((m, 8), device="cuda", generator=gen) * 3).to(w_dtype)
            ids.add_(0)
            inputs = stage_inputs(topo, x, ids, w)
            assert inputs.ids.dtype == torch.int32 and inputs.weights.dtype == torch.float32
            assert torch.equal(inputs.ids, ids.to(torch.int32).cpu())
            assert torch.equal(inputs.weights, w.to(torch.float32).cpu())
            assert torch.equal(inputs.source.cpu(), x.to(torch.bfloat16).cpu())
            strided = ids.t().contiguous().t()  # not contiguous: the same values
            assert not strided.is_contiguous() or m == 1
            staged = stage_inputs(topo, x, strided, w)
            assert torch.equal(staged.ids, inputs.ids)
            assert torch.equal(staged.weights, inputs.weights)
