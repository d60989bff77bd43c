"""Run by tests/service/test_oip.py in its own process: the stock Triton gRPC client
defines the `inference.*` protobuf messages too, so it cannot share a process
with our server's stubs. Usage: python oip_triton_client.py ADDRESS CASES.npz OUT.json"""

from __future__ import annotations

import json
import sys

import ml_dtypes
import numpy as np
import tritonclient.grpc as grpcclient
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
    }
    for n in range(int(cases["count"])):
        x, ids, w = cases[f"x{n}"], cases[f"ids{n}"], cases[f"w{n}"]
        model, layer = str(cases[f"model{n}"]), int(cases[f"layer{n}"])
        report["results"].append(infer(client, x, ids, w, model, layer))
    report["model_ready_after"] = client.is_model_ready("moe")
    client.close()
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
