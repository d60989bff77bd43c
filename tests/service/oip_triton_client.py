"""Run by tests/service/test_oip.py in its own process: the stock Triton gRPC client
defines the `inference.*` protobuf messages too, so it cannot share a process
with our server's stubs. Usage: python oip_triton_client.py ADDRESS CASES.npz OUT.json

Besides tritonclient's InferenceServerClient (raw tensors), typed contents are sent
through the stub and messages tritonclient ships (Triton's own protobuf), since its
client API always sends raw bytes."""

from __future__ import annotations

import json
import sys

import grpc
import ml_dtypes
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException


def infer(client, x, ids, w, model="moe", layer=None):
    tensors = []
    for name, array, dtype in (
        ("hidden_states", x.astype(ml_dtypes.bfloat16), "BF16"),
        ("topk_ids", ids, "INT64" if ids.dtype == np.int64 else "INT32"),
        ("topk_weights", w.astype(np.float32), "FP32"),
    ):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        tensors.append(t)
    params = None if layer is None else {"layer": int(layer)}
    try:
        result = client.infer(model, tensors, parameters=params)
    except InferenceServerException as e:
        return {"status": e.status(), "message": e.message()}
    return {"output": result.as_numpy("output").astype(np.float32).tolist()}


def typed_infer(stub, x, ids, w, layer, typed, break_it=None):
    """ModelInfer with the inputs named in `typed` in typed contents, the others raw.
    break_it: one mistake to make (the server must refuse it)."""
    request = service_pb2.ModelInferRequest(model_name="moe")
    request.parameters["layer"].int64_param = int(layer)
    ids_type = "INT64" if ids.dtype == np.int64 else "INT32"
    for name, array, dtype in (
        ("hidden_states", x.astype(ml_dtypes.bfloat16), "BF16"),
        ("topk_ids", ids, ids_type),
        ("topk_weights", w.astype(np.float32), "FP32"),
    ):
        inp = request.inputs.add(name=name, datatype=dtype, shape=list(array.shape))
        if name not in typed:
            request.raw_input_contents.append(array.tobytes())
        elif dtype == "BF16":
            inp.contents.fp32_contents.extend(array.astype(np.float32).ravel().tolist())
        elif dtype == "INT32":
            inp.contents.int_contents.extend(array.ravel().tolist())
        elif dtype == "INT64":
            inp.contents.int64_contents.extend(array.ravel().tolist())
        else:
            inp.contents.fp32_contents.extend(array.ravel().tolist())
    ids_in = request.inputs[1]
    if break_it == "wrong_field":
        ids_in.contents.int64_contents.extend([0])
    elif break_it == "short":
        del ids_in.contents.int_contents[-1]
    elif break_it == "also_raw":
        request.raw_input_contents.insert(1, ids.tobytes())
    try:
        reply = stub.ModelInfer(request, timeout=60)
    except grpc.RpcError as e:
        return {"status": e.code().name, "message": e.details()}
    out = np.frombuffer(reply.raw_output_contents[0], dtype=ml_dtypes.bfloat16)
    return {"output": out.reshape(list(reply.outputs[0].shape)).astype(np.float32).tolist()}


def stats_of(client) -> dict:
    stats = client.get_inference_statistics("moe", as_json=True)["model_stats"]
    assert len(stats) == 1 and stats[0]["name"] == "moe", stats
    return stats[0]


def main(address: str, cases_path: str, out_path: str) -> None:
    cases = np.load(cases_path)
    client = grpcclient.InferenceServerClient(url=address)
    meta = client.get_model_metadata("moe")
    report = {
        "live": client.is_server_live(),
        "ready": client.is_server_ready(),
        "model_ready": client.is_model_ready("moe"),
        "server_name": client.get_server_metadata().name,
        "inputs": [i.name for i in meta.inputs],
        "output_shape": list(meta.outputs[0].shape),
        "results": [],
        "config": client.get_model_config("moe", as_json=True)["config"],
        "index": client.get_model_repository_index(as_json=True).get("models", []),
        "stats_before": stats_of(client),
    }
    for n in range(int(cases["count"])):
        x, ids, w = cases[f"x{n}"], cases[f"ids{n}"], cases[f"w{n}"]
        model, layer = str(cases[f"model{n}"]), int(cases[f"layer{n}"])
        report["results"].append(infer(client, x, ids, w, model, layer))
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        x, w, layer = cases["x0"], cases["w0"], int(cases["layer0"])
        ids32, ids64 = cases["ids0"].astype(np.int32), cases["ids0"].astype(np.int64)
        report["typed"] = {
            "ids_weights": typed_infer(stub, x, ids32, w, layer, {"topk_ids", "topk_weights"}),
            "ids64": typed_infer(stub, x, ids64, w, layer, {"topk_ids"}),
            "bf16": typed_infer(stub, x, ids32, w, layer, {"hidden_states"}),
            "wrong_field": typed_infer(stub, x, ids32, w, layer, {"topk_ids"}, "wrong_field"),
            "short": typed_infer(stub, x, ids32, w, layer, {"topk_ids"}, "short"),
            "also_raw": typed_infer(stub, x, ids32, w, layer, {"topk_ids"}, "also_raw"),
        }
    report["stats_after"] = stats_of(client)
    every = client.get_inference_statistics(as_json=True)["model_stats"]  # no name: all models
    report["stats_every_model"] = [(m["name"], m["version"]) for m in every]
    report["model_ready_after"] = client.is_model_ready("moe")
    client.close()
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
