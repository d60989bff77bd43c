"""A frontend's process, run by tests/service/test_install.py with the python of a
throwaway virtual environment that holds the expertd wheel and, depending on MODE,
tritonclient[grpc] or kserve. It calls real shards with the expertd client, with
expertd's own OIP stubs, and with the other package's client, all in this one process.

Usage: python install_frontend.py MODE ADDRESSES CASES.npz OUT.npz OUT.json
MODE: client (expertd alone), tritonclient or kserve."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys

import numpy as np

SERVER_ONLY = ("ninja", "safetensors", "prometheus_client", "triton")


def oip_inputs(x, ids, w, tensor):
    """The three OIP inputs as (name, datatype, shape, raw bytes), built by `tensor`."""
    import torch

    raw = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    return [
        tensor("hidden_states", "BF16", list(x.shape), raw),
        tensor("topk_ids", "INT32", list(ids.shape), ids.astype(np.int32).tobytes()),
        tensor("topk_weights", "FP32", list(w.shape), w.astype(np.float32).tobytes()),
    ]


def bf16(raw: bytes, shape) -> np.ndarray:
    import torch

    return torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).float().reshape(shape).numpy()


def infer_with(pb, stub, x, ids, w, layer) -> np.ndarray:
    """ModelInfer through generated OIP stubs (ours or the other package's)."""

    def tensor(name, datatype, shape, raw):
        return pb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape), raw

    pairs = oip_inputs(x, ids, w, tensor)
    request = pb.ModelInferRequest(
        model_name="moe",
        inputs=[t for t, _ in pairs],
        raw_input_contents=[r for _, r in pairs],
    )
    request.parameters["layer"].int64_param = layer
    reply = stub.ModelInfer(request, timeout=60)
    return bf16(reply.raw_output_contents[0], list(reply.outputs[0].shape))


def with_tritonclient(address, x, ids, w, layer, report) -> np.ndarray:
    """tritonclient's own client, unchanged (ml_dtypes gives it a bfloat16 array)."""
    import ml_dtypes
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url=address)
    report["other_live"] = client.is_server_live() and client.is_model_ready("moe")
    report["other_inputs"] = [i.name for i in client.get_model_metadata("moe").inputs]
    tensors = []
    for name, array, datatype in (
        ("hidden_states", x.astype(ml_dtypes.bfloat16), "BF16"),
        ("topk_ids", ids.astype(np.int32), "INT32"),
        ("topk_weights", w.astype(np.float32), "FP32"),
    ):
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    result = client.infer("moe", tensors, parameters={"layer": layer})
    return result.as_numpy("output").astype(np.float32)


def with_kserve(address, x, ids, w, layer, report) -> np.ndarray:
    import grpc
    from kserve.inference_client import InferenceGRPCClient
    from kserve.protocol.grpc import grpc_predict_v2_pb2, grpc_predict_v2_pb2_grpc

    async def probe():
        client = InferenceGRPCClient(url=address)
        try:
            live = await client.is_server_live() and await client.is_model_ready("moe")
        finally:
            await client.close()
        return live

    report["other_live"] = bool(asyncio.run(probe()))
    with grpc.insecure_channel(address) as channel:
        stub = grpc_predict_v2_pb2_grpc.GRPCInferenceServiceStub(channel)
        meta = stub.ModelMetadata(grpc_predict_v2_pb2.ModelMetadataRequest(name="moe"), timeout=30)
        report["other_inputs"] = [i.name for i in meta.inputs]
        return infer_with(grpc_predict_v2_pb2, stub, x, ids, w, layer)


def main(mode: str, addresses: str, cases_path: str, out_path: str, report_path: str) -> None:
    report: dict = {"present": [m for m in SERVER_ONLY if importlib.util.find_spec(m)]}
    cases = np.load(cases_path)
    x, ids, ids0, w = cases["x"], cases["ids"], cases["ids0"], cases["w"]
    layer = int(cases["layer"])
    shards = addresses.split(",")
    outputs = {}
    if mode == "tritonclient":  # theirs first, then ours
        outputs["other"] = with_tritonclient(shards[0], x, ids0, w, layer, report)

    import grpc
    import torch
    from google.protobuf import __version__ as protobuf_version

    import expertd
    from expertd.client import ExpertClient
    from expertd.v1 import inference_pb2, inference_pb2_grpc

    with ExpertClient(shards) as client:
        out = client.forward(
            layer,
            torch.from_numpy(x).to(torch.bfloat16),
            torch.from_numpy(ids),
            torch.from_numpy(w),
        )
    outputs["client"] = out.float().numpy()
    with grpc.insecure_channel(shards[0]) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        report["ours_live"] = stub.ServerLive(inference_pb2.ServerLiveRequest(), timeout=30).live
        outputs["ours"] = infer_with(inference_pb2, stub, x, ids0, w, layer)

    if mode == "kserve":  # ours first, then theirs
        outputs["other"] = with_kserve(shards[0], x, ids0, w, layer, report)

    report["present_after"] = [m for m in SERVER_ONLY if m in sys.modules]
    report["expertd_file"] = expertd.__file__
    report["protobuf"] = protobuf_version
    report["grpcio"] = grpc.__version__
    np.savez(out_path, **outputs)
    with open(report_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
