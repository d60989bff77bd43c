"""End to end: the real client against 8 real shard servers on loopback, checked
against the reference of the whole layer."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from conftest import PRESET, SHARDS, hidden, routing
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertd import wire
from expertd.aioloop import run
from expertd.client import AsyncExpertClient, ExpertClient
from expertd.kernels import reference_forward, relative_error
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import expertd_pb2_grpc as pb_grpc

TOL = 1e-2


@pytest.fixture(scope="module")
def client(addresses):
    with ExpertClient(addresses, timeout=60) as c:
        yield c


@pytest.mark.parametrize("m", [0, 1, 3, 64, 257])
def test_forward_matches_reference(client, full_layers, m):
    gen = torch.Generator().manual_seed(m)
    x = hidden(m, gen)
    ids, w = routing(m, gen)
    if m >= 3:
        ids[1, 2] = -1  # a dropped route
        ids[2, :] = -1  # a token with no route at all
    for layer in (0, 1):
        out = client.forward(layer, x, ids, w)
        assert out.shape == (m, PRESET.hidden_size) and out.dtype == torch.bfloat16
        ref = reference_forward(full_layers[layer], x, ids, w)
        assert relative_error(out, ref) <= TOL
        if m >= 3:
            assert (out[2] == 0).all()


def test_all_routes_on_one_expert(client, full_layers):
    gen = torch.Generator().manual_seed(1)
    x = hidden(50, gen)
    ids = torch.full((50, 8), 17, dtype=torch.int32)
    w = torch.rand((50, 8), generator=gen)
    out = client.forward(0, x, ids, w)
    assert relative_error(out, reference_forward(full_layers[0], x, ids, w)) <= TOL


def test_tokens_that_skip_most_shards(client, full_layers):
    # Each token's routes live on one or two shards only: the others get no
    # request for it (and some shards get no request at all).
    gen = torch.Generator().manual_seed(2)
    x = hidden(6, gen)
    ids = torch.tensor(
        [[0, 1, 2, 3, -1, -1, -1, -1]] * 3 + [[8, 9, 40, 41, 42, -1, -1, -1]] * 3, dtype=torch.int32
    )
    w = torch.rand((6, 8), generator=gen)
    out = client.forward(1, x, ids, w)
    assert relative_error(out, reference_forward(full_layers[1], x, ids, w)) <= TOL


def test_result_on_callers_dtype_inputs(client, full_layers):
    gen = torch.Generator().manual_seed(3)
    x = hidden(5, gen)
    ids, w = routing(5, gen)
    a = client.forward(0, x.float(), ids.long(), w.to(torch.bfloat16))
    b = client.forward(0, x, ids, w.to(torch.bfloat16).float())
    assert torch.equal(a, b)


def test_async_client_same_result(addresses, client):
    # Concurrent calls are merged into one forward on each shard: the fp32 sums
    # then run over other shapes, so bits may differ; the values may not.
    gen = torch.Generator().manual_seed(4)
    x = hidden(40, gen)
    ids, w = routing(40, gen)
    want = client.forward(1, x, ids, w)

    async def go():
        async with AsyncExpertClient(addresses) as ac:
            outs = await asyncio.gather(*(ac.forward(1, x, ids, w) for _ in range(4)))
        return outs

    for out in run(go()):
        assert relative_error(out, want) <= 2e-3


def test_describe_reports_shard(addresses):
    with grpc.insecure_channel(addresses[3]) as ch:
        d = pb_grpc.ExpertServiceStub(ch).Describe(pb.DescribeRequest(), timeout=5)
    assert (d.hidden_size, d.intermediate_size, d.num_experts, d.top_k) == (512, 256, 64, 8)
    assert list(d.experts) == list(range(24, 32)) and list(d.layers) == [0, 1]
    assert d.backend == "reference" and d.weight_dtype == "nvfp4" and d.version
    assert d.num_shards == SHARDS and d.shard_index == 3


def test_health_serving(addresses):
    with grpc.insecure_channel(addresses[0]) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "expertd.v1.ExpertService", "inference.GRPCInferenceService"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_services(addresses):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(addresses[0]) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(iter(stub.ServerReflectionInfo(iter([req]), timeout=5)))
    names = {s.name for s in reply.list_services_response.service}
    assert {"expertd.v1.ExpertService", "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_answers_under_v1_and_v1alpha(addresses, version):
    """grpcurl and current clients ask grpc.reflection.v1 first; older ones v1alpha.
    Both list every service and describe them, the v1 reflection service included."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2  # v1's messages are the same

    method = f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="inference.GRPCInferenceService"
        ),
        reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="grpc.reflection.v1.ServerReflection"
        ),
    ]
    with grpc.insecure_channel(addresses[0]) as ch:
        call = ch.stream_stream(
            method,
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        listed, oip_file, v1_file = list(call(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert names == {
        "expertd.v1.ExpertService",
        "inference.GRPCInferenceService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    files = {}
    for reply in (oip_file, v1_file):
        assert not reply.HasField("error_response"), reply.error_response.error_message
        for raw in reply.file_descriptor_response.file_descriptor_proto:
            f = descriptor_pb2.FileDescriptorProto.FromString(raw)
            files[f.package] = f
    oip_methods = {m.name for m in files["inference"].service[0].method}
    assert {"ModelInfer", "ModelConfig", "ModelStatistics", "RepositoryIndex"} <= oip_methods
    (v1_service,) = files["grpc.reflection.v1"].service
    assert v1_service.method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"


def test_stream_tags_results_and_survives_a_bad_request(addresses, full_layers):
    gen = torch.Generator().manual_seed(5)
    shard0 = list(range(8))  # experts of shard 0
    reqs, expected = [], {}
    for rid in range(1, 7):
        x = hidden(rid, gen)
        ids = torch.tensor(shard0, dtype=torch.int32)[torch.randint(0, 8, (rid, 2), generator=gen)]
        w = torch.rand((rid, 2), generator=gen)
        reqs.append(
            pb.ForwardRequest(
                layer=0,
                request_id=rid,
                hidden_states=wire.encode(x),
                topk_ids=wire.encode(ids),
                topk_weights=wire.encode(w),
            )
        )
        expected[rid] = reference_forward(full_layers[0], x, ids, w)
    bad = pb.ForwardRequest(layer=9, request_id=99, hidden_states=reqs[0].hidden_states)
    with grpc.insecure_channel(addresses[0]) as ch:
        replies = list(
            pb_grpc.ExpertServiceStub(ch).ForwardStream(
                iter([*reqs[:3], bad, *reqs[3:]]), timeout=30
            )
        )
    by_id = {r.request_id: r for r in replies}
    assert set(by_id) == {*expected, 99}
    assert by_id[99].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "layer 9" in by_id[99].error.message
    for rid, ref in expected.items():
        out = wire.decode(by_id[rid].output, "output")
        assert relative_error(out, ref) <= TOL
        assert by_id[rid].timing.total_us >= by_id[rid].timing.compute_us


def test_many_concurrent_calls(client, full_layers):
    from concurrent.futures import ThreadPoolExecutor

    gen = torch.Generator().manual_seed(6)
    cases = []
    for m in (1, 9, 33, 70) * 3:
        ids, w = routing(m, gen)
        cases.append((hidden(m, gen), ids, w))

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda c: client.forward(0, *c), cases))
    for (x, ids, w), out in zip(cases, outs, strict=True):
        assert relative_error(out, reference_forward(full_layers[0], x, ids, w)) <= TOL
