"""The Open Inference Protocol (KServe v2 gRPC) on the same port as our own
service: model "moe", the layer as request parameter "layer" (docs/protocol.md).

A ModelInfer request is translated to our ForwardRequest (no copy of the
tensor bytes beyond protobuf's own) and goes through the same admission,
validation and batching as Forward; the errors keep their status codes.
"""

from __future__ import annotations

import time

import grpc

import expertd
from expertd.codec import parse_forward_response
from expertd.server.service import ExpertServicer
from expertd.server.validate import RequestError, invalid
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import inference_pb2 as oip
from expertd.v1 import inference_pb2_grpc as oip_grpc

MODEL = "moe"
VERSION = "1"
# OIP datatype names -> our wire dtypes, per input.
INPUTS = {
    "hidden_states": {"BF16": pb.BF16},
    "topk_ids": {"INT32": pb.INT32, "INT64": pb.INT64},
    "topk_weights": {"FP32": pb.FP32, "BF16": pb.BF16},
}


class InferenceServicer(oip_grpc.GRPCInferenceServiceServicer):
    def __init__(self, experts: ExpertServicer) -> None:
        self.experts = experts

    def _ready(self) -> bool:
        return self.experts.bank is not None and not self.experts.draining

    async def _check_model(self, name: str, version: str, context) -> None:
        if name != MODEL or version not in ("", VERSION):
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown model {name!r} version {version!r}; this server serves {MODEL!r} "
                f"version {VERSION!r}",
            )

    async def ServerLive(self, request, context):
        return oip.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return oip.ServerReadyResponse(ready=self._ready())

    async def ModelReady(self, request, context):
        await self._check_model(request.name, request.version, context)
        return oip.ModelReadyResponse(ready=self._ready())

    async def ServerMetadata(self, request, context):
        return oip.ServerMetadataResponse(name="expertd", version=expertd.__version__)

    async def ModelMetadata(self, request, context):
        await self._check_model(request.name, request.version, context)
        bank = self.experts.bank
        if bank is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is still loading its experts")
        h = bank.info.hidden_size
        meta = oip.ModelMetadataResponse.TensorMetadata
        return oip.ModelMetadataResponse(
            name=MODEL,
            versions=[VERSION],
            platform="expertd",
            inputs=[
                meta(name="hidden_states", datatype="BF16", shape=[-1, h]),
                meta(name="topk_ids", datatype="INT32", shape=[-1, -1]),
                meta(name="topk_weights", datatype="FP32", shape=[-1, -1]),
            ],
            outputs=[meta(name="output", datatype="BF16", shape=[-1, h])],
        )

    async def ModelInfer(self, request, context):
        await self._check_model(request.model_name, request.model_version, context)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        try:
            forward = to_forward_request(request)
            reply = await self.experts._forward(forward, deadline)
        except RequestError as e:
            self.experts._count("ModelInfer", e.code)
            await context.abort(e.code, e.message)
        self.experts._count("ModelInfer", grpc.StatusCode.OK)
        out = parse_forward_response(reply).output
        return oip.ModelInferResponse(
            model_name=MODEL,
            model_version=VERSION,
            id=request.id,
            outputs=[
                oip.ModelInferResponse.InferOutputTensor(
                    name="output", datatype="BF16", shape=list(out.shape)
                )
            ],
            raw_output_contents=[bytes(out.data)],
        )


def to_forward_request(request: oip.ModelInferRequest) -> pb.ForwardRequest:
    """ModelInferRequest -> ForwardRequest; RequestError naming what is wrong."""
    if len(request.raw_input_contents) != len(request.inputs):
        raise invalid(
            f"{len(request.inputs)} inputs but {len(request.raw_input_contents)} raw_input_contents: "
            "send every tensor in raw_input_contents"
        )
    for wanted in request.outputs:
        if wanted.name != "output":
            raise invalid(f"unknown output {wanted.name!r}; the model has one output, 'output'")
    layer = 0
    if "layer" in request.parameters:
        param = request.parameters["layer"]
        if param.WhichOneof("parameter_choice") not in ("int64_param", "uint64_param"):
            raise invalid("parameter 'layer' must be an integer")
        layer = getattr(param, param.WhichOneof("parameter_choice"))
        if not 0 <= layer < 2**32:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"layer {layer} is not served here")
    tensors = {}
    for inp, raw in zip(request.inputs, request.raw_input_contents, strict=True):
        allowed = INPUTS.get(inp.name)
        if allowed is None:
            raise invalid(f"unknown input {inp.name!r}; expected {', '.join(INPUTS)}")
        if inp.datatype not in allowed:
            raise invalid(f"{inp.name}: datatype {inp.datatype}, expected {' or '.join(allowed)}")
        tensors[inp.name] = pb.Tensor(dtype=allowed[inp.datatype], shape=list(inp.shape), data=raw)
    return pb.ForwardRequest(layer=layer, request_id=0, **tensors)
