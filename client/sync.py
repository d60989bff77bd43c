"""ExpertClient: the synchronous SDK.

    with ExpertClient(["10.0.0.1:50051", "10.0.0.2:50051"], token=...) as client:
        out = client.forward(layer, hidden_states, topk_ids, topk_weights)
        fut = client.submit(layer + 1, x2, ids2, w2)  # concurrent.futures.Future
        out2 = fut.result()

It runs an AsyncExpertClient on the process's client event loop (one thread,
shared by every ExpertClient and never closed), so the sync and asyncio clients
share one engine (routing, replicas, retries, probing). Input checks and device
staging run on the caller's thread; the fan-out runs on the loop, where many
calls from many threads are in flight at once over the same channels.

One loop for all clients, not one per client: grpc.aio hands events of every
loop of a process to one poller, and an event for a loop that was closed (a
closed client's, when each had its own) raises in that poller and leaves the
events behind it waiting for the next wake-up (logged as "Event loop is closed"
from PollerCompletionQueue._handle_events).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future

import torch

from expertd import tracing
from expertd.aioloop import shared_loop
from expertd.client import onstream
from expertd.client.aio import AsyncExpertClient, Fallback
from expertd.client.core import to_caller
from expertd.client.routing import Topology


class ExpertClient:
    def __init__(self, addresses: list[str], **options) -> None:
        """Discovers the shards before returning (CoverageError when none answers).

        options: those of AsyncExpertClient (timeout, discover_timeout, metadata,
        token, tls, max_attempts, retry_backoff, refresh_s, transport, attempt_share,
        busy_retries, busy_backoff, metrics, slot_tokens). transport "auto" (the
        default) picks shared memory for each shard on this host, see
        docs/dataplane.md.

        on_stream (default False): a CUDA caller's calls that cuda-ipc slots can carry
        are queued on its current stream and `forward` returns at once; their errors
        are raised by a later `forward` or by `synchronize()` (client/onstream.py).

        graph_slots (default 0; with on_stream): N cuda-ipc slots leased now from every
        replica on this GPU and kept for calls captured in CUDA graphs: a `forward`
        while the caller's stream is capturing is recorded into the graph and runs on
        each replay, taking one kept slot per shard for good (so N bounds the calls
        captured per shard). Their errors (the shard's status, a shard gone, a
        deadline) are raised by a later `forward` or by `synchronize()`, called once
        the caller's stream has been synchronized (onstream.GraphCalls)."""
        if not addresses:
            raise ValueError("ExpertClient needs at least one address")
        on_stream = bool(options.pop("on_stream", False))
        graph_slots = int(options.pop("graph_slots", 0))
        if graph_slots and not on_stream:
            raise ValueError("graph_slots needs on_stream=True")
        self._tracker = onstream.Tracker() if on_stream else None
        self._graphs = onstream.GraphCalls() if graph_slots > 0 else None
        self._loop = shared_loop("expertd-client")
        self._closed = False
        if on_stream and torch.cuda.is_available():
            # the caller works on a GPU: its CUDA context first, so that the slots leased
            # (from every shard on this host) are cuda-ipc ones
            torch.cuda.init()
        # (on failure connect closes what it opened)
        self._client: AsyncExpertClient = self._run(AsyncExpertClient.connect(addresses, **options))
        if on_stream and torch.cuda.is_available():
            self._run(self._client.open_dataplanes())
        if self._graphs is not None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
            for slot in self._run(self._client.keep_graph_slots(graph_slots, device)):
                slot.map_routes()  # page-locked and mapped now: a capture cannot do it

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ExpertClient is closed")

    @property
    def addresses(self) -> list[str]:
        return self._client.addresses

    @property
    def topology(self) -> Topology:
        return self._client.topology

    @property
    def unreachable(self) -> dict[str, str]:
        return self._client.unreachable

    def stats(self) -> dict[str, dict]:
        return self._client.stats()

    def timings(self) -> dict[str, dict]:
        """Per stage of the calls so far (client/telemetry.py): count, total_s, mean_us."""
        return self._client.timings()

    def refresh(self, timeout: float | None = None) -> Topology:
        """Describe every address now and rebuild the expert -> shard map."""
        self._check_open()
        return self._run(self._client.refresh(timeout))

    def submit(
        self,
        layer: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        **options,
    ) -> Future:
        """Start a forward; -> Future of the bf16 [M, H] result on hidden_states' device.

        options: timeout, metadata, request_id, token (AsyncExpertClient.prepare).
        Bad inputs raise here, at once; everything after (routing, replicas,
        deadline) ends in the future."""
        self._check_open()
        inputs, deadline, md = self._client.prepare(
            hidden_states, topk_ids, topk_weights, **options
        )
        parent = tracing.current_context() if tracing.active() else None  # the caller's span
        host = asyncio.run_coroutine_threadsafe(
            self._client.execute(layer, inputs, deadline, md, parent), self._loop
        )
        result: Future = Future()

        def done(f: Future) -> None:
            if f.cancelled():
                result.cancel()
            elif f.exception() is not None:
                result.set_exception(f.exception())
            else:  # not the caller's thread or stream: a blocking copy to its device
                result.set_result(to_caller(f.result(), inputs, non_blocking=False))

        host.add_done_callback(done)
        return result

    def forward(self, layer: int, hidden_states, topk_ids, topk_weights, **kwargs) -> torch.Tensor:
        """-> bf16 [M, H] on hidden_states' device: the layer's expert output.

        kwargs: timeout (s), metadata, request_id (sent as x-request-id), token.

        With shared-memory slots leased from every shard (same host, docs/dataplane.md)
        the call runs on this thread: write the slots, ring them all, wait for all, sum.
        Anything else (a shard on gRPC, a failed attempt that another replica may take
        over, every slot busy) runs on the client's event loop, as `submit` does."""
        self._check_open()
        client = self._client
        if hidden_states.is_cuda and torch.cuda.is_current_stream_capturing():
            return self._captured(layer, hidden_states, topk_ids, topk_weights, **kwargs)
        if self._tracker is not None:
            self._tracker.raise_error()
            if self._graphs is not None:
                self._graphs.raise_error()
            if hidden_states.is_cuda and kwargs.keys() <= {"timeout"}:
                out = self._on_stream(layer, hidden_states, topk_ids, topk_weights, **kwargs)
                if out is not None:
                    return out
        inputs, deadline, md = client.prepare(hidden_states, topk_ids, topk_weights, **kwargs)
        try:
            if not client.direct_ready():
                raise Fallback
            out = client.execute_direct(layer, inputs, deadline, md)
        except Fallback:
            parent = tracing.current_context() if tracing.active() else None
            out = self._run(client.execute(layer, inputs, deadline, md, parent))
        return to_caller(out, inputs)  # on this thread: non-blocking, on the caller's stream

    def _on_stream(self, layer, hidden_states, topk_ids, topk_weights, timeout=None):
        """Queue the call on the caller's stream (client/onstream.py) -> its bf16 [M, H]
        output, or None when that path cannot take it."""
        client = self._client
        topo = client.topology
        if topo is None:
            return None
        m = _stream_rows(topo.hidden_size, hidden_states, topk_ids, topk_weights)
        if m is None:
            return None  # the usual path checks and words the error
        device = hidden_states.device
        picked = client.stream_slots(layer, device)
        while picked is None and self._tracker.wait_one():  # every slot queued: the oldest
            picked = client.stream_slots(layer, device)
        if picked is None:
            return None
        slots = [slot for _ep, _shard, slot in picked]
        timeout = client.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        x = hidden_states.detach()
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        try:
            ok = onstream.usable(slots, m, topk_ids.shape[1])
        except ValueError:
            ok = None
        if not ok:  # nothing queued: the usual path runs it (or words the error)
            for ep, _shard, slot in picked:
                ep.dataplane.release(slot)
            return None
        try:
            out = onstream.enqueue(
                slots, layer, x, topk_ids.detach(), topk_weights.detach(), timeout
            )
        finally:  # queued, or partly: the tracker sees each answered, or ends it
            for ep, shard, slot in picked:
                self._tracker.add(slot, deadline, ep, layer, list(shard.experts))
        for ep, _shard, _slot in picked:
            ep.calls += 1
            ep.stream_calls += 1
        return out

    def _captured(self, layer, hidden_states, topk_ids, topk_weights, timeout=None):
        """A call made while the caller's stream captures a CUDA graph: recorded into
        the graph on kept slots (client/onstream.py) -> its bf16 [M, H] output."""
        if self._graphs is None:
            raise RuntimeError(
                "a forward inside a CUDA graph capture needs ExpertClient(..., on_stream=True, "
                "graph_slots=N): N slots per shard kept for the graph's calls"
            )
        client = self._client
        topo = client.topology
        if topo is None:
            raise RuntimeError("no shard is known yet: call forward once before capturing")
        m = _stream_rows(topo.hidden_size, hidden_states, topk_ids, topk_weights)
        if m is None:
            raise ValueError(
                f"a captured call takes hidden_states [M, {topo.hidden_size}] and integer "
                "topk_ids and topk_weights [M, K], all on one GPU; got "
                f"{tuple(hidden_states.shape)}, {tuple(topk_ids.shape)} {topk_ids.dtype}, "
                f"{tuple(topk_weights.shape)}"
            )
        picked = client.graph_slots(layer, hidden_states.device)
        if picked is None:
            raise RuntimeError(
                f"no kept slot for a call of layer {layer} captured in a CUDA graph: each "
                "captured call keeps one slot per shard for good (graph_slots per shard), "
                "and every shard of the layer must be on cuda-ipc slots on this GPU"
            )
        slots = [slot for _ep, _shard, slot in picked]
        timeout = client.timeout if timeout is None else timeout
        x = hidden_states.detach()
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        onstream.usable(slots, m, topk_ids.shape[1])  # ValueError: does not fit a slot
        out = onstream.enqueue(
            slots, layer, x, topk_ids.detach(), topk_weights.detach(), timeout, graph=True
        )
        for ep, shard, slot in picked:
            self._graphs.add(slot, ep, layer, list(shard.experts), timeout)
        return out

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait until every call queued on a stream (on_stream) is finished, then raise
        the first one's error that no call has raised yet (ShardCallError). The
        outputs of a failed call hold no answer. Calls replayed from CUDA graphs are
        not waited for (synchronize the stream first): the shards' hosts are, until
        they have finished the replays they took, and their errors are looked for
        then."""
        if self._tracker is not None:
            self._tracker.synchronize(timeout)
        if self._graphs is not None:
            self._graphs.settle(self._client.timeout if timeout is None else timeout)
            self._graphs.check()
            self._graphs.raise_error()

    def close(self) -> None:
        """Close the channels (calls still in flight fail); the shared loop keeps running."""
        if self._closed:
            return
        self._closed = True
        if self._tracker is not None:
            self._tracker.close()  # each queued call is answered or fails at its deadline
        if self._graphs is not None:
            self._graphs.close()  # the graphs' slots: unmapped as their leases close
        self._run(self._client.close())

    def __enter__(self) -> ExpertClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stream_rows(hidden: int, hidden_states, topk_ids, topk_weights) -> int | None:
    """M for a call a stream can carry (hidden_states [M, hidden], integer topk_ids and
    topk_weights [M, K], all on its device), else None."""
    if (
        hidden_states.dim() != 2
        or hidden_states.shape[1] != hidden
        or topk_ids.dim() != 2
        or topk_ids.shape[0] != hidden_states.shape[0]
        or topk_weights.shape != topk_ids.shape
        or topk_ids.dtype.is_floating_point
        or topk_ids.dtype == torch.bool
        or topk_ids.device != hidden_states.device
        or topk_weights.device != hidden_states.device
    ):
        return None
    return hidden_states.shape[0]
