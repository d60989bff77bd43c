"""The Open Inference Protocol (KServe v2 gRPC) on the shard's port, driven by
the stock Triton client, unchanged, from its own process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import hidden, routing

from expertd.kernels import reference_forward, relative_error

pytest.importorskip("tritonclient")


@pytest.fixture(scope="module")
def report(addresses, tmp_path_factory):
    gen = torch.Generator().manual_seed(0)
    cases, saved = [], {}
    for n, (m, layer, ids_dtype, model) in enumerate(
        [
            (11, 0, np.int32, "moe"),
            (5, 1, np.int64, "moe"),
            (2, 0, np.int32, "nope"),
            (2, 9, np.int32, "moe"),
            (3, 0, np.int32, "moe"),
        ]
    ):
        x = hidden(m, gen)
        ids, w = routing(m, gen)
        ids[ids >= 8] = -1  # shard 0 owns experts 0-7
        if n == 4:
            ids[0, 0] = 64  # out of range
        cases.append((x, ids, w, layer))
        saved |= {
            f"x{n}": x.float().numpy(),
            f"ids{n}": ids.numpy().astype(ids_dtype),
            f"w{n}": w.numpy(),
            f"model{n}": np.array(model),
            f"layer{n}": np.array(layer),
        }
    tmp = tmp_path_factory.mktemp("oip")
    np.savez(tmp / "cases.npz", count=np.array(len(cases)), **saved)
    script = Path(__file__).with_name("oip_triton_client.py")
    done = subprocess.run(
        [sys.executable, str(script), addresses[0], str(tmp / "cases.npz"), str(tmp / "out.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return cases, json.loads((tmp / "out.json").read_text())


def test_server_and_model_endpoints(report):
    _, r = report
    assert r["live"] and r["ready"] and r["model_ready"] and r["model_ready_after"]
    assert r["server_name"] == "expertd"
    assert r["inputs"] == ["hidden_states", "topk_ids", "topk_weights"] and r["output_shape"] == [
        -1,
        512,
    ]


def test_infer_matches_reference(report, full_layers):
    cases, r = report
    for n in (0, 1):
        x, ids, w, layer = cases[n]
        out = torch.tensor(r["results"][n]["output"])
        assert out.shape == (x.shape[0], 512)
        assert relative_error(out, reference_forward(full_layers[layer], x, ids, w)) <= 1e-2


def test_errors_keep_their_codes(report):
    _, r = report
    unknown_model, unknown_layer, bad_ids = r["results"][2:5]
    assert "NOT_FOUND" in unknown_model["status"] and "unknown model" in unknown_model["message"]
    assert "NOT_FOUND" in unknown_layer["status"] and "layer 9" in unknown_layer["message"]
    assert "INVALID_ARGUMENT" in bad_ids["status"] and "topk_ids[0, 0] = 64" in bad_ids["message"]


def test_missing_layer_is_refused_not_layer_zero(addresses):
    """A request without the 'layer' parameter names the parameter; it never runs layer 0."""
    import grpc

    from expertd.v1 import inference_pb2 as oip
    from expertd.v1 import inference_pb2_grpc as oip_grpc

    gen = torch.Generator().manual_seed(1)
    x = hidden(2, gen)
    ids, w = routing(2, gen)
    request = oip.ModelInferRequest(model_name="moe")
    for name, t, dtype in (
        ("hidden_states", x, "BF16"),
        ("topk_ids", ids, "INT32"),
        ("topk_weights", w, "FP32"),
    ):
        request.inputs.add(name=name, datatype=dtype, shape=list(t.shape))
        request.raw_input_contents.append(t.contiguous().view(torch.uint8).numpy().tobytes())
    with grpc.insecure_channel(addresses[0]) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(request, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'layer'" in e.value.details() and "required" in e.value.details()
        request.parameters["layer"].int64_param = 1
        answer = stub.ModelInfer(request, timeout=30)
        assert list(answer.outputs[0].shape) == [2, x.shape[1]]
