"""The expertd.v1.ExpertService servicer (grpc.aio).

Requests are decoded on the event loop (a view over the received bytes, no
copy); validation and the backend forward run on one compute thread, so the
device sees one forward at a time and the loop stays free for I/O.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

import expertd
from expertd import wire
from expertd.server.bank import ExpertBank
from expertd.server.validate import Limits, RequestError, parse_forward
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import expertd_pb2_grpc as pb_grpc

log = logging.getLogger("expertd.server")

STREAM_WINDOW = 64  # requests of one stream computed or queued at once


class ExpertServicer(pb_grpc.ExpertServiceServicer):
    def __init__(self, limits: Limits, shard_index: int = 0, num_shards: int = 1) -> None:
        self.limits = limits
        self.bank: ExpertBank | None = None  # None while loading
        self.draining = False
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expertd-compute")
        self._shard = (shard_index, num_shards)
        self._instance = f"{time.time_ns():x}"

    def attach(self, bank: ExpertBank) -> None:
        self.bank = bank

    def close(self) -> None:
        self._compute.shutdown(wait=True)

    # -- the work of one request -------------------------------------------------

    def _check_ready(self) -> ExpertBank:
        if self.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "server is draining")
        if self.bank is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "server is still loading its experts")
        return self.bank

    def _run(
        self, bank: ExpertBank, req: pb.ForwardRequest, received_ns: int, deadline: float | None
    ):
        """On the compute thread: validate, forward, encode. A call accepted before
        draining began still completes here."""
        if deadline is not None and time.monotonic() >= deadline:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while queued")
        args = parse_forward(req, bank.info, self.limits, bank.has_layer)
        started = time.perf_counter_ns()
        with torch.inference_mode():
            out = bank.forward(args.layer, args.x, args.ids, args.weights)
        done = time.perf_counter_ns()
        timing = pb.Timing(
            queue_us=(started - received_ns) // 1000,
            compute_us=(done - started) // 1000,
            total_us=(done - received_ns) // 1000,
        )
        return pb.ForwardResponse(request_id=req.request_id, output=wire.encode(out), timing=timing)

    async def _forward(self, req: pb.ForwardRequest, deadline: float | None) -> pb.ForwardResponse:
        received = time.perf_counter_ns()
        bank = self._check_ready()  # new calls are refused while draining
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._compute, self._run, bank, req, received, deadline)

    # -- RPCs ------------------------------------------------------------------------

    async def Forward(self, request, context):
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        try:
            return await self._forward(request, deadline)
        except RequestError as e:
            await context.abort(e.code, e.message)
        except Exception:  # a bug of ours, never the client's fault: say so, keep serving
            log.exception("forward failed (request_id=%d)", request.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error in forward")

    async def ForwardStream(self, request_iterator, context):
        results: asyncio.Queue = asyncio.Queue()
        window = asyncio.Semaphore(STREAM_WINDOW)
        tasks: set[asyncio.Task] = set()

        async def one(req: pb.ForwardRequest) -> None:
            try:
                resp = await self._forward(req, None)
            except RequestError as e:
                resp = pb.ForwardResponse(
                    request_id=req.request_id,
                    error=pb.Error(code=e.code.value[0], message=e.message),
                )
            except Exception:
                log.exception("stream forward failed (request_id=%d)", req.request_id)
                code = grpc.StatusCode.INTERNAL.value[0]
                resp = pb.ForwardResponse(
                    request_id=req.request_id, error=pb.Error(code=code, message="internal error")
                )
            await results.put(resp)
            window.release()

        async def read() -> None:
            async for req in request_iterator:
                await window.acquire()
                task = asyncio.create_task(one(req))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks))
            await results.put(None)

        reader = asyncio.create_task(read())
        try:
            while (resp := await results.get()) is not None:
                yield resp
            await reader
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def Describe(self, request, context):
        try:
            bank = self._check_ready()
        except RequestError as e:
            await context.abort(e.code, e.message)
        info = bank.info
        device = bank.backend.device
        device_name = str(device)
        if device.type == "cuda":
            device_name += f" ({torch.cuda.get_device_name(device)})"
        return pb.DescribeResponse(
            version=expertd.__version__,
            backend=bank.backend.name,
            device=device_name,
            hidden_size=info.hidden_size,
            intermediate_size=info.intermediate_size,
            num_experts=info.num_experts,
            top_k=info.top_k,
            layers=list(info.layers),
            experts=list(info.experts),
            weight_dtype="nvfp4",
            activation_dtype=pb.BF16,
            output_dtype=pb.BF16,
            model=info.source,
            instance_id=self._instance,
            max_tokens_per_request=self.limits.max_tokens,
            max_message_bytes=self.limits.max_message_bytes(info.hidden_size),
            shard_index=self._shard[0],
            num_shards=self._shard[1],
        )
