"""The Open Inference Protocol (KServe v2 gRPC) on the same port as our own
service: model "moe", the layer as request parameter "layer" (docs/protocol.md).

A ModelInfer request is translated to our ForwardRequest (no copy of the
tensor bytes beyond protobuf's own; typed contents are packed once) and goes
through the same admission, validation and batching as Forward; the errors keep
their status codes. Triton's ModelConfig, ModelStatistics and RepositoryIndex
describe the model to perf_analyzer, model-analyzer and tritonclient.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

import expertd
from expertd import tracing
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
from expertd.server.service import ExpertServicer, traceparent_of
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
# The typed-contents field each accepted datatype's values travel in, and their dtype on
# our wire (little-endian). KServe v2 has no typed field for FP16 or BF16.
TYPED = {
    "INT32": ("int_contents", np.dtype("<i4")),
    "INT64": ("int64_contents", np.dtype("<i8")),
    "FP32": ("fp32_contents", np.dtype("<f4")),
}
CONFIG_TYPES = {"BF16": oip.TYPE_BF16, "INT32": oip.TYPE_INT32, "FP32": oip.TYPE_FP32}


@dataclass(slots=True)
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += max(ns, 0)

    def proto(self) -> oip.StatisticDuration:
        return oip.StatisticDuration(count=self.count, ns=self.ns)


@dataclass(slots=True)
class InferStats:
    """ModelInfer's counts and cumulative times, as Triton's ModelStatistics reports
    them: each succeeded request's time split into queue (admission to the batch's
    start, validation included, from the answer's own Timing), compute_input (reading
    the request's tensors: typed contents packed, shared memory copied), compute_infer
    (the batch's forward) and compute_output (the rest: the answer's encoding and the
    shared-memory write)."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    last_inference_ms: int = 0

    def succeeded(self, total_ns: int, input_ns: int, timing: pb.Timing) -> None:
        queue_ns, infer_ns = timing.queue_us * 1000, timing.compute_us * 1000
        self.success.add(total_ns)
        self.queue.add(queue_ns)
        self.compute_input.add(input_ns)
        self.compute_infer.add(infer_ns)
        self.compute_output.add(total_ns - input_ns - queue_ns - infer_ns)
        self.last_inference_ms = time.time_ns() // 1_000_000

    def failed(self, total_ns: int) -> None:
        self.fail.add(total_ns)
        self.last_inference_ms = time.time_ns() // 1_000_000

    def proto(self) -> oip.ModelStatistics:
        n = self.success.count  # one execution per request: max_batch_size is 0
        return oip.ModelStatistics(
            name=MODEL,
            version=VERSION,
            last_inference=self.last_inference_ms,
            inference_count=n,
            execution_count=n,
            inference_stats=oip.InferStatistics(
                success=self.success.proto(),
                fail=self.fail.proto(),
                queue=self.queue.proto(),
                compute_input=self.compute_input.proto(),
                compute_infer=self.compute_infer.proto(),
                compute_output=self.compute_output.proto(),
                cache_hit=oip.StatisticDuration(),
                cache_miss=oip.StatisticDuration(),
            ),
        )


class InferenceServicer(oip_grpc.GRPCInferenceServiceServicer):
    def __init__(self, experts: ExpertServicer, allow_shm: bool = False) -> None:
        self.experts = experts
        self.shm = SharedMemoryRegistry(allow_shm)
        self.stats = InferStats()

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
                meta(name=name, datatype=dtype, shape=dims) for name, dtype, dims in _inputs(h)
            ],
            outputs=[meta(name="output", datatype="BF16", shape=[-1, h])],
        )

    async def ModelInfer(self, request, context):
        await self._check_model(request.model_name, request.model_version, context)
        started = time.perf_counter_ns()
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        lease = self.shm.lease(self._max_read_bytes())  # regions this request uses
        copying = None  # the last copy through them run off the event loop (large tensors)
        succeeded = False
        try:
            try:
                forward = to_forward_request(request, lease)
                into = self._output_region(request, forward, lease)
                loop = asyncio.get_running_loop()
                if lease.pending:
                    copying = loop.run_in_executor(None, lease.fill)
                    await asyncio.shield(copying)
                read = time.perf_counter_ns()
                parent = traceparent_of(context) if tracing.active() else ""
                reply = await self.experts._forward(forward, deadline, parent)
                answer = parse_forward_response(reply)
                out = answer.output
                if into is not None:
                    region, ref = into
                    if len(out.data) > ref.byte_size:
                        raise invalid(_too_small(ref, len(out.data)))
                    if len(out.data) <= INLINE_BYTES:
                        region.write(ref.offset, out.data)
                    else:
                        copying = loop.run_in_executor(None, region.write, ref.offset, out.data)
                        await asyncio.shield(copying)
                response = oip.ModelInferResponse(
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
                succeeded = True
            except RequestError as e:
                self.experts._count("ModelInfer", e.code)
                await context.abort(e.code, e.message)
        finally:
            lease.release_after(copying)
            total = time.perf_counter_ns() - started
            if succeeded:
                self.stats.succeeded(total, read - started, answer.timing)
            else:  # refused, or a fault (answered INTERNAL by the request guard)
                self.stats.failed(total)
        self.experts._count("ModelInfer", grpc.StatusCode.OK)
        return response

    async def ModelConfig(self, request, context):
        await self._check_model(request.name, request.version, context)
        bank = self.experts.bank
        if bank is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is still loading its experts")
        info = bank.info
        h = info.hidden_size
        device = bank.backend.device
        if device.type == "cuda":
            group = oip.ModelInstanceGroup(
                name=MODEL, kind=oip.ModelInstanceGroup.KIND_GPU, count=1, gpus=[device.index or 0]
            )
        else:
            group = oip.ModelInstanceGroup(
                name=MODEL, kind=oip.ModelInstanceGroup.KIND_CPU, count=1
            )
        shard, shards = self.experts._shard
        parameters = {
            "layer": "request parameter, an integer, required: which MoE layer to run",
            "layers": ",".join(map(str, info.layers)),
            "experts": _ranges(info.experts),
            "num_experts": str(info.num_experts),
            "top_k": str(info.top_k),
            "hidden_size": str(h),
            "intermediate_size": str(info.intermediate_size),
            "shard": f"{shard} of {shards}",
            "max_tokens_per_request": str(self.experts.limits.max_tokens),
            "backend": bank.backend.name,
        }
        config = oip.ModelConfig(
            name=MODEL,
            platform="expertd",
            backend="expertd",
            max_batch_size=0,
            input=[
                oip.ModelInput(name=name, data_type=CONFIG_TYPES[dtype], dims=dims)
                for name, dtype, dims in _inputs(h)
            ],
            output=[oip.ModelOutput(name="output", data_type=oip.TYPE_BF16, dims=[-1, h])],
            instance_group=[group],
            parameters={k: oip.ModelParameter(string_value=v) for k, v in parameters.items()},
        )
        return oip.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request, context):
        if request.name:
            await self._check_model(request.name, request.version, context)
        elif request.version not in ("", VERSION):
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no model has version {request.version!r}"
            )
        return oip.ModelStatisticsResponse(model_stats=[self.stats.proto()])

    async def RepositoryIndex(self, request, context):
        if request.repository_name:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown model repository {request.repository_name!r}; expertd has one, "
                "unnamed: leave repository_name empty",
            )
        if self._ready():
            state, reason = "READY", ""
        elif self.experts.draining:
            state, reason = "UNAVAILABLE", "server is draining"
        else:
            state, reason = "LOADING", "server is still loading its experts"
        if request.ready and state != "READY":
            return oip.RepositoryIndexResponse()
        index = oip.RepositoryIndexResponse.ModelIndex
        return oip.RepositoryIndexResponse(
            models=[index(name=MODEL, version=VERSION, state=state, reason=reason)]
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


def _inputs(hidden: int) -> list[tuple[str, str, list[int]]]:
    """(name, datatype, shape) of each input, in the preferred datatype."""
    return [
        ("hidden_states", "BF16", [-1, hidden]),
        ("topk_ids", "INT32", [-1, -1]),
        ("topk_weights", "FP32", [-1, -1]),
    ]


def _ranges(ids) -> str:
    """Ascending ids as compact ranges: (0, 1, 2, 5) -> "0-2,5"."""
    out, run = [], []
    for i in ids:
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def _too_small(ref, needed: int) -> str:
    return (
        f"output: shared_memory_byte_size {ref.byte_size} (region '{ref.region}') cannot hold "
        f"the output's {needed} bytes"
    )


def to_forward_request(
    request: oip.ModelInferRequest, lease: RequestLease | None = None
) -> ForwardRequestView:
    """ModelInferRequest -> the ForwardRequest it means; RequestError naming what is wrong.

    Each input comes from exactly one place: a shared-memory region it names (copied
    out through `lease`, which the caller releases), its typed `contents`, or
    raw_input_contents, which holds one entry per remaining input, in order. (The
    standard has a request use raw_input_contents or typed contents, not both; a mix is
    accepted here, as it is unambiguous.)"""
    refs = [tensor_ref(inp) for inp in request.inputs]
    typed = [inp.HasField("contents") for inp in request.inputs]
    for n, (inp, ref, has_contents) in enumerate(zip(request.inputs, refs, typed, strict=True)):
        if ref is not None and has_contents:
            raise invalid(
                f"inputs[{n}] ({inp.name}): both a shared-memory region and contents; "
                "send each input one way"
            )
    in_shm = sum(ref is not None for ref in refs)
    in_contents = sum(typed)
    expected = len(request.inputs) - in_shm - in_contents
    if len(request.raw_input_contents) != expected:
        if in_contents and len(request.raw_input_contents) == expected + in_contents:
            n = typed.index(True)
            raise invalid(
                f"inputs[{n}] ({request.inputs[n].name}): both contents and a "
                "raw_input_contents entry; raw_input_contents holds only the inputs sent "
                "without contents or shared memory"
            )
        elsewhere = [f"{in_shm} in shared memory"] if in_shm else []
        elsewhere += [f"{in_contents} in contents"] if in_contents else []
        elsewhere_text = f" ({', '.join(elsewhere)})" if elsewhere else ""
        raise invalid(
            f"{len(request.inputs)} inputs{elsewhere_text} but "
            f"{len(request.raw_input_contents)} raw_input_contents: send every tensor not in "
            "shared memory or contents in raw_input_contents"
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
        if ref is not None:
            tensor.data = _read_input(inp, tensor, ref, lease)
        elif inp.HasField("contents"):
            tensor.data = _typed_contents(inp)
        else:
            tensor.data = memoryview(next(raw))
        setattr(forward, inp.name, tensor)
    return forward


def _typed_contents(inp) -> memoryview:
    """An input's typed contents as the bytes of its datatype (exact: each accepted
    datatype's field holds values of that very type)."""
    if inp.datatype not in TYPED:
        raise invalid(
            f"{inp.name}: datatype {inp.datatype} has no typed contents field in the Open "
            "Inference Protocol (KServe v2 has none for FP16 or BF16); send this input in "
            "raw_input_contents or shared memory"
        )
    name, dtype = TYPED[inp.datatype]
    for given, _ in inp.contents.ListFields():
        if given.name != name:
            raise invalid(
                f"{inp.name}: contents.{given.name} is set, but {inp.datatype} values go in "
                f"contents.{name}"
            )
    values = getattr(inp.contents, name)
    shape = list(inp.shape)
    if all(d >= 0 for d in shape) and len(values) != math.prod(shape):
        raise invalid(
            f"{inp.name}: contents.{name} holds {len(values)} values, shape {shape} needs "
            f"{math.prod(shape)}"
        )
    return memoryview(np.asarray(values, dtype=dtype).tobytes())


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
