"""The shard server on the GPU: the `cuda` backend behind the real gRPC service,
CUDA graphs for small merged batches, eager above; checked against the float64
reference. Skipped without CUDA."""

from __future__ import annotations

import grpc
import pytest
import torch

from expertd import wire
from expertd.kernels import reference_forward, relative_error
from expertd.server.app import BackgroundServer
from expertd.server.config import ServerConfig, shard_experts
from expertd.server.synthetic import get_preset, synthetic_layer
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import expertd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

CASES = {"small": (0, 8, [1, 3, 64, 257, 1500]), "muse-spark": (3, 8, [1, 7, 300, 2048])}


@pytest.fixture(scope="module", params=list(CASES))
def served(request):
    preset = get_preset(request.param)
    shard, shards, _ = CASES[request.param]
    config = ServerConfig(
        synthetic=preset.name, layers=1, seed=4, shard=shard, num_shards=shards, device="cuda"
    )
    experts = shard_experts(preset.num_experts, shard, shards)
    with (
        BackgroundServer(config) as server,
        grpc.insecure_channel(
            server.address, options=[("grpc.max_receive_message_length", -1)]
        ) as channel,
    ):
        full = synthetic_layer(preset, 4, 0, experts, device="cuda")
        yield request.param, preset, experts, full, server, pb_grpc.ExpertServiceStub(channel)


def call(stub, x, ids, w, timeout=60):
    req = pb.ForwardRequest(
        layer=0,
        hidden_states=wire.encode(x),
        topk_ids=wire.encode(ids),
        topk_weights=wire.encode(w),
    )
    return stub.Forward(req, timeout=timeout)


def routed(preset, experts, m, gen):
    """Top-k of all E experts; routes to other shards stay in (this shard must skip them)."""
    logits = torch.randn((m, preset.num_experts), generator=gen)
    top = logits.topk(preset.top_k, dim=1)
    ids = top.indices.to(torch.int32)
    ids[::5, 0] = experts[0]  # make sure this shard has work
    ids[1::7, 1] = -1
    return ids, torch.softmax(top.values, dim=1)


def test_describe_says_cuda(served):
    _, _, experts, _, server, stub = served
    d = stub.Describe(pb.DescribeRequest(), timeout=10)
    assert d.backend == "cuda" and "cuda" in d.device and list(d.experts) == experts
    assert server._running.servicer.batcher.runner.graphs is not None  # graphs captured


def test_forward_matches_reference(served):
    name, preset, experts, full, _, stub = served
    gen = torch.Generator().manual_seed(0)
    for m in CASES[name][2]:  # graph buckets and, above 1024, the eager path
        x = torch.randn((m, preset.hidden_size), generator=gen).to(torch.bfloat16)
        ids, w = routed(preset, experts, m, gen)
        out = wire.decode(call(stub, x, ids, w).output, "output")
        ref = reference_forward(full, x.cuda(), ids.cuda(), w.cuda(), torch.float64).cpu()
        err = relative_error(out, ref)
        print(f"server {name} M={m}: rel err {err:.2e}")
        assert torch.isfinite(out.float()).all() and err <= 1e-2


def test_nan_refused_on_the_gpu_path(served):
    _, preset, experts, full, _, stub = served
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((6, preset.hidden_size), generator=gen).to(torch.bfloat16)
    ids, w = routed(preset, experts, 6, gen)
    x[4, 11] = float("nan")
    with pytest.raises(grpc.RpcError) as info:
        call(stub, x, ids, w)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hidden_states[4, 11] is nan" in info.value.details()
    x[4, 11] = 0.0
    out = wire.decode(call(stub, x, ids, w).output, "output")
    ref = reference_forward(full, x.cuda(), ids.cuda(), w.cuda(), torch.float64).cpu()
    assert relative_error(out, ref) <= 1e-2
