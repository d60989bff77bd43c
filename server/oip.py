"""The Open Inference Protocol (KServe v2 gRPC) on the same port as our own
service: model "moe", the layer as request parameter "layer" (docs/protocol.md).

A ModelInfer request is translated to our ForwardRequest (no copy of the
tensor bytes beyond protobuf's own) and goes through the same admission,
validation and batching as Forward; the errors keep their status codes.
"""

from __future__ import annotations

import asyncio
import math
import time

import grpc

import expertd
from expertd.codec import ForwardRequestView, TensorView, parse_forward_response
from expertd.server.oip_shm import (
    CUDA,
    INLINE_BYTES,
    SYSTEM,
    RequestLease,
    SharedMemoryRegistry,
    cuda_available,
    tensor_ref,
)
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
ITEMSIZE = {pb.BF16: 2, pb.FP32: 4, pb.INT32: 4, pb.INT64: 8}


class InferenceServicer(oip_grpc.GRPCInferenceServiceServicer):
    def __init__(self, experts: ExpertServicer, allow_shm: bool = False) -> None:
        self.experts = experts
        self.shm = SharedMemoryRegistry(allow_shm)

    def close(self) -> None:
        """Server shutdown: close every shared-memory region."""
        self.shm.close()

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
        extensions = []
        if self.shm.allowed:
            extensions.append("system_shared_memory")
            if cuda_available():
                extensions.append("cuda_shared_memory")
        return oip.ServerMetadataResponse(
            name="expertd", version=expertd.__version__, extensions=extensions
        )

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
        lease = self.shm.lease(self._max_read_bytes())  # regions this request uses
        copying = None  # the last copy through them run off the event loop (large tensors)
        try:
            try:
                forward = to_forward_request(request, lease)
                into = self._output_region(request, forward, lease)
                loop = asyncio.get_running_loop()
                if lease.pending:
                    copying = loop.run_in_executor(None, lease.fill)
                    await asyncio.shield(copying)
                reply = await self.experts._forward(forward, deadline)
                out = parse_forward_response(reply).output
                if into is not None:
                    region, ref = into
                    if len(out.data) > ref.byte_size:
                        raise invalid(_too_small(ref, len(out.data)))
                    if len(out.data) <= INLINE_BYTES:
                        region.write(ref.offset, out.data)
                    else:
                        copying = loop.run_in_executor(None, region.write, ref.offset, out.data)
                        await asyncio.shield(copying)
            except RequestError as e:
                self.experts._count("ModelInfer", e.code)
                await context.abort(e.code, e.message)
        finally:
            lease.release_after(copying)
        self.experts._count("ModelInfer", grpc.StatusCode.OK)
        return oip.ModelInferResponse(
            model_name=MODEL,
            model_version=VERSION,
            id=request.id,
            outputs=[
                oip.ModelInferResponse.InferOutputTensor(
                    name="output", datatype="BF16", shape=list(out.shape)
                )
            ],
            # An output written to shared memory keeps its place here, empty (as Triton).
            raw_output_contents=[b"" if into is not None else bytes(out.data)],
        )

    def _max_read_bytes(self) -> int:
        bank = self.experts.bank
        return self.experts.limits.max_message_bytes(bank.info.hidden_size if bank else 0)

    def _output_region(self, request, forward, lease: RequestLease):
        """(region, TensorRef) when the output goes to shared memory, else None; checks
        before any compute that the region has room for [M, hidden] BF16."""
        refs = [tensor_ref(wanted) for wanted in request.outputs]
        ref = next((r for r in refs if r is not None), None)
        if ref is None:
            return None
        region = lease.region("output", ref)
        shape = list(forward.hidden_states.shape) if forward.hidden_states is not None else []
        if self.experts.bank is not None and len(shape) == 2 and shape[0] >= 0:
            needed = shape[0] * self.experts.bank.info.hidden_size * 2
            if needed > ref.byte_size:
                raise invalid(_too_small(ref, needed))
        return region, ref

    # -- shared-memory extensions (Triton's RPCs) ------------------------------------

    async def _shm_call(self, method: str, context, work):
        try:
            result = work()
        except RequestError as e:
            self.experts._count(method, e.code)
            await context.abort(e.code, e.message)
        self.experts._count(method, grpc.StatusCode.OK)
        return result

    async def SystemSharedMemoryStatus(self, request, context):
        regions = await self._shm_call(
            "SystemSharedMemoryStatus", context, lambda: self.shm.status(SYSTEM, request.name)
        )
        status = oip.SystemSharedMemoryStatusResponse.RegionStatus
        return oip.SystemSharedMemoryStatusResponse(
            regions={
                r.name: status(name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size)
                for r in regions
            }
        )

    async def SystemSharedMemoryRegister(self, request, context):
        await self._shm_call(
            "SystemSharedMemoryRegister",
            context,
            lambda: self.shm.register_system(
                request.name, request.key, request.offset, request.byte_size
            ),
        )
        return oip.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context):
        await self._shm_call(
            "SystemSharedMemoryUnregister",
            context,
            lambda: self.shm.unregister(SYSTEM, request.name),
        )
        return oip.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request, context):
        regions = await self._shm_call(
            "CudaSharedMemoryStatus", context, lambda: self.shm.status(CUDA, request.name)
        )
        status = oip.CudaSharedMemoryStatusResponse.RegionStatus
        return oip.CudaSharedMemoryStatusResponse(
            regions={
                r.name: status(name=r.name, device_id=r.device_id, byte_size=r.byte_size)
                for r in regions
            }
        )

    async def CudaSharedMemoryRegister(self, request, context):
        await self._shm_call(
            "CudaSharedMemoryRegister",
            context,
            lambda: self.shm.register_cuda(
                request.name, request.raw_handle, request.device_id, request.byte_size
            ),
        )
        return oip.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(self, request, context):
        await self._shm_call(
            "CudaSharedMemoryUnregister", context, lambda: self.shm.unregister(CUDA, request.name)
        )
        return oip.CudaSharedMemoryUnregisterResponse()


def _too_small(ref, needed: int) -> str:
    return (
        f"output: shared_memory_byte_size {ref.byte_size} (region '{ref.region}') cannot hold "
        f"the output's {needed} bytes"
    )


def to_forward_request(
    request: oip.ModelInferRequest, lease: RequestLease | None = None
) -> ForwardRequestView:
    """ModelInferRequest -> the ForwardRequest it means; RequestError naming what is wrong.

    Inputs come from raw_input_contents (one each, in order, for the inputs that are not
    in shared memory) or from the shared-memory regions they name, copied out through
    `lease` (which the caller releases)."""
    refs = [tensor_ref(inp) for inp in request.inputs]
    in_shm = sum(ref is not None for ref in refs)
    if len(request.raw_input_contents) != len(request.inputs) - in_shm:
        in_shm_text = f", {in_shm} of them in shared memory," if in_shm else ""
        raise invalid(
            f"{len(request.inputs)} inputs{in_shm_text} but {len(request.raw_input_contents)} "
            "raw_input_contents: send every tensor not in shared memory in raw_input_contents"
        )
    for wanted in request.outputs:
        if wanted.name != "output":
            raise invalid(f"unknown output {wanted.name!r}; the model has one output, 'output'")
    if "layer" not in request.parameters:  # never a silent layer 0
        raise invalid("request parameter 'layer' (an integer) is required: which MoE layer to run")
    param = request.parameters["layer"]
    if param.WhichOneof("parameter_choice") not in ("int64_param", "uint64_param"):
        raise invalid("parameter 'layer' must be an integer")
    layer = getattr(param, param.WhichOneof("parameter_choice"))
    if not 0 <= layer < 2**32:
        raise RequestError(grpc.StatusCode.NOT_FOUND, f"layer {layer} is not served here")
    forward = ForwardRequestView()
    forward.layer = layer
    raw = iter(request.raw_input_contents)
    for inp, ref in zip(request.inputs, refs, strict=True):
        allowed = INPUTS.get(inp.name)
        if allowed is None:
            raise invalid(f"unknown input {inp.name!r}; expected {', '.join(INPUTS)}")
        if inp.datatype not in allowed:
            raise invalid(f"{inp.name}: datatype {inp.datatype}, expected {' or '.join(allowed)}")
        tensor = TensorView()
        tensor.dtype = allowed[inp.datatype]
        tensor.shape = list(inp.shape)
        if ref is None:
            tensor.data = memoryview(next(raw))
        else:
            tensor.data = _read_input(inp, tensor, ref, lease)
        setattr(forward, inp.name, tensor)
    return forward


def _read_input(inp, tensor: TensorView, ref, lease: RequestLease | None):
    """A shared-memory input's bytes, after checking their size against its shape."""
    if lease is None:
        raise invalid(f"{inp.name}: shared-memory inputs are not accepted here")
    if all(d >= 0 for d in tensor.shape):
        expected = math.prod(tensor.shape) * ITEMSIZE[tensor.dtype]
        if ref.byte_size != expected:
            raise invalid(
                f"{inp.name}: shared_memory_byte_size {ref.byte_size} does not match shape "
                f"{tensor.shape} of {inp.datatype} ({expected} bytes)"
            )
    return lease.read(inp.name, ref)
