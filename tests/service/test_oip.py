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


def test_model_config_reads_in_triton_terms(report):
    """get_model_config decodes with Triton's own model_config.proto: the enum names and
    field numbers are Triton's."""
    _, r = report
    config = r["config"]
    assert config["name"] == "moe" and config["backend"] == "expertd"
    assert config.get("max_batch_size", 0) == 0  # the tensors carry their own first dimension
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [
        ("hidden_states", "TYPE_BF16", ["-1", "512"]),
        ("topk_ids", "TYPE_INT32", ["-1", "-1"]),
        ("topk_weights", "TYPE_FP32", ["-1", "-1"]),
    ]
    assert [(o["name"], o["data_type"], o["dims"]) for o in config["output"]] == [
        ("output", "TYPE_BF16", ["-1", "512"])
    ]
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    params = {k: v["string_value"] for k, v in config["parameters"].items()}
    assert params["experts"] == "0-7" and params["layers"] == "0,1"
    assert params["num_experts"] == "64" and params["shard"] == "0 of 8"


def test_repository_index_lists_the_model_ready(report):
    _, r = report
    assert r["index"] == [{"name": "moe", "version": "1", "state": "READY"}]


def test_statistics_count_what_the_client_did(report):
    """Triton's inference statistics, before and after the client's calls: every
    ModelInfer for "moe" counted once, as a success or a failure, with its times."""
    _, r = report
    before, after = r["stats_before"], r["stats_after"]
    calls = [res for n, res in enumerate(r["results"]) if n != 2]  # case 2: another model
    calls += list(r["typed"].values())
    ok = sum("output" in res for res in calls)
    assert ok == 4 and len(calls) - ok == 6

    def count(stats, key):
        return int(stats.get("inference_stats", {}).get(key, {}).get("count", 0))

    def ns(stats, key):
        return int(stats.get("inference_stats", {}).get(key, {}).get("ns", 0))

    assert count(after, "success") - count(before, "success") == ok
    assert count(after, "fail") - count(before, "fail") == len(calls) - ok
    assert int(after["inference_count"]) - int(before.get("inference_count", 0)) == ok
    for key in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert count(after, key) - count(before, key) == ok, key
    assert ns(after, "compute_infer") > ns(before, "compute_infer")
    assert ns(after, "fail") > ns(before, "fail")
    parts = sum(
        ns(after, k) - ns(before, k)
        for k in ("queue", "compute_input", "compute_infer", "compute_output")
    )
    assert parts <= ns(after, "success") - ns(before, "success")  # parts of the whole
    assert int(after["last_inference"]) > 0
    assert r["stats_every_model"] == [["moe", "1"]]


def test_typed_contents_are_accepted_exactly(report):
    """topk_ids (INT32 and INT64) and topk_weights (FP32) sent as typed contents give
    the very bytes the raw request gave."""
    _, r = report
    raw = r["results"][0]["output"]
    assert r["typed"]["ids_weights"]["output"] == raw
    assert r["typed"]["ids64"]["output"] == raw


def test_typed_contents_refusals_name_the_field(report):
    _, r = report
    refused = {k: v for k, v in r["typed"].items() if "status" in v}
    assert set(refused) == {"bf16", "wrong_field", "short", "also_raw"}
    assert all(v["status"] == "INVALID_ARGUMENT" for v in refused.values())
    assert "hidden_states" in refused["bf16"]["message"]
    assert "BF16 has no typed contents field" in refused["bf16"]["message"]
    assert "contents.int64_contents" in refused["wrong_field"]["message"]
    assert "contents.int_contents" in refused["wrong_field"]["message"]
    assert "holds 87 values, shape [11, 8] needs 88" in refused["short"]["message"]
    assert "inputs[1] (topk_ids)" in refused["also_raw"]["message"]
    assert "raw_input_contents" in refused["also_raw"]["message"]


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
