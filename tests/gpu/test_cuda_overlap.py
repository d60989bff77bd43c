"""Batches in flight on the GPU (server/runner.py): one packed copy in on the
upload stream, the forward on the compute stream, one packed copy out on the
download stream, two slots. Checked through the real server with many
concurrent requests of mixed sizes (graph buckets, eager above them and above
the graphs' top_k, int64 ids, bf16 weights, NaN) against the float64 reference
and against the same requests run one at a time, and on the runner itself:
each stage overlaps the others, and launching never waits for the device.
Skipped without CUDA; the CPU side of the same code: tests/service/test_staging.py."""

from __future__ import annotations

import dataclasses
import random
import time

import grpc
import pytest
import torch
from loadgen import outcomes

from expertd import wire
from expertd.kernels import reference_forward, relative_error
from expertd.server import runner as runner_module
from expertd.server.app import BackgroundServer
from expertd.server.config import ServerConfig, shard_experts
from expertd.server.runner import FUSED_ROWS, BatchRunner
from expertd.server.synthetic import get_preset, synthetic_layer
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import expertd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

SIZES = {
    "small": [1, 1, 2, 3, 5, 8, 13, 16, 31, 64, 100, 257, 1024, 1100],
    "muse-spark": [1, 1, 2, 3, 7, 16, 33, 64, 200, 1024, 1300],
}
SHARD = {"small": (0, 8), "muse-spark": (3, 8)}
OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


@pytest.fixture(scope="module", params=list(SIZES))
def served(request):
    preset = get_preset(request.param)
    shard, shards = SHARD[request.param]
    config = ServerConfig(
        synthetic=preset.name, layers=1, seed=5, shard=shard, num_shards=shards, device="cuda"
    )
    experts = shard_experts(preset.num_experts, shard, shards)
    with BackgroundServer(config) as server:
        full = synthetic_layer(preset, 5, 0, experts, device="cuda")
        yield request.param, preset, experts, full, server


def make_case(preset, experts, m, seed, *, top_k=None, int64=False, bf16_w=False, nan=False):
    gen = torch.Generator().manual_seed(seed)
    k = top_k or preset.top_k
    x = torch.randn((m, preset.hidden_size), generator=gen).to(torch.bfloat16)
    logits = torch.randn((m, preset.num_experts), generator=gen)
    top = logits.topk(k, dim=1)
    ids = top.indices.to(torch.int32)
    ids[::3, 0] = experts[seed % len(experts)]  # this shard has work
    ids[1::5, -1] = -1
    w = torch.softmax(top.values, dim=1)
    if nan:
        x[m // 2, 7] = float("nan")
    ids = ids.long() if int64 else ids
    w = w.bfloat16() if bf16_w else w
    req = pb.ForwardRequest(
        layer=0,
        request_id=seed,
        hidden_states=wire.encode(x),
        topk_ids=wire.encode(ids),
        topk_weights=wire.encode(w),
    )
    return req, (x, ids, w)


def mixed_cases(name, preset, experts, n=64):
    rnd = random.Random(9)
    cases = []
    for seed in range(n):
        m = rnd.choice(SIZES[name])
        cases.append(
            make_case(
                preset,
                experts,
                m,
                seed,
                top_k=preset.top_k + 2 if seed % 11 == 0 else rnd.randint(1, preset.top_k),
                int64=seed % 5 == 0,
                bf16_w=seed % 7 == 0,
                nan=seed % 13 == 6,
            )
        )
    return cases


def send_all(address, cases, timeout=300):
    """Every request at once (one channel, concurrent unary calls) -> replies or errors."""
    with grpc.insecure_channel(address, options=OPTIONS) as channel:
        stub = pb_grpc.ExpertServiceStub(channel)
        return outcomes([stub.Forward.future(req, timeout=timeout) for req, _ in cases])


def send_one_by_one(address, cases, timeout=300):
    with grpc.insecure_channel(address, options=OPTIONS) as channel:
        stub = pb_grpc.ExpertServiceStub(channel)
        replies = []
        for req, _ in cases:
            try:
                replies.append(stub.Forward(req, timeout=timeout))
            except grpc.RpcError as e:
                replies.append(e)
        return replies


def check(name, cases, replies, full, sequential=None):
    for i, ((req, (x, ids, w)), got) in enumerate(zip(cases, replies, strict=True)):
        if req.request_id % 13 == 6:  # a NaN request fails alone
            assert isinstance(got, grpc.RpcError), f"request {req.request_id} should fail"
            assert got.code() == grpc.StatusCode.INVALID_ARGUMENT and "is nan" in got.details()
            continue
        assert not isinstance(got, grpc.RpcError), got
        assert got.request_id == req.request_id
        out = wire.decode(got.output, "output")
        ref = reference_forward(full, x.cuda(), ids.cuda(), w.float().cuda(), torch.float64)
        err = relative_error(out, ref.cpu())
        assert torch.isfinite(out.float()).all() and err <= 1e-2, (name, x.shape, err)
        if sequential is not None:  # the same request alone: the same bits
            alone = wire.decode(sequential[i].output, "output")
            assert torch.equal(out.view(torch.int16), alone.view(torch.int16)), (name, x.shape)


def test_concurrent_mixed_requests_match_the_reference(served):
    name, preset, experts, full, server = served
    cases = mixed_cases(name, preset, experts)
    assert server._running.servicer.batcher.runner.depth == 2
    for _ in range(2):  # the second round reuses every slot and bucket dirtied by the first
        check(name, cases, send_all(server.address, cases), full)


def test_pipelined_batches_are_bit_identical_to_one_at_a_time(served):
    """No merging (one request a batch), so each request runs exactly the forward it
    runs alone, in whichever slot and on whichever thread (small lone requests run
    on the event loop, others on the compute thread): overlapped batches must not
    share a byte."""
    name, preset, experts, full, server = served
    config = dataclasses.replace(server.config, max_batch_requests=1, listen="127.0.0.1:0")
    with BackgroundServer(config, bank=server.bank) as solo:
        batcher, ran_here = solo._running.servicer.batcher, []
        # small lone batches run on the event loop: in their handler, or by the batcher
        run_here, run_now = batcher._run_here, batcher.run_now
        batcher._run_here = lambda jobs: (ran_here.append(len(jobs)), run_here(jobs))

        def counted_now(job):
            reply = run_now(job)
            if reply is not None:
                ran_here.append(1)
            return reply

        batcher.run_now = counted_now
        cases = mixed_cases(name, preset, experts, n=48)
        sequential = send_one_by_one(solo.address, cases)
        assert ran_here, "no small request ran on the event loop"
        check(name, cases, send_all(solo.address, cases), full, sequential)


def _runner(server) -> BatchRunner:
    runner = BatchRunner(server.bank, depth=3)
    runner.warmup()
    return runner


def _busy(stream: torch.cuda.Stream, ms: float = 200.0) -> None:
    """Keep `stream` busy for about `ms` (a spin kernel: nothing behind it on that
    stream starts before it ends)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(ms * 1e-3 * 2e9))  # ~2 GHz SM clock: an upper estimate


def test_copies_overlap_compute_and_launch_never_waits(served):
    name, preset, experts, _, server = served
    runner = _runner(server)
    # 100 tokens: above the buckets whose graphs hold the copies (FUSED_ROWS)
    a, b, c = (make_case(preset, experts, m, s)[1] for m, s in ((100, 1), (300, 2), (1100, 3)))
    want = [runner.run(0, [x], [i], [w])[0].clone() for x, i, w in (a, b, c)]

    # Compute stream stalled: batch A's copy in still completes, and launching returns.
    _busy(runner._compute)
    t0 = time.perf_counter()
    fa = runner.launch(0, [a[0]], [a[1]], [a[2]])
    assert time.perf_counter() - t0 < 0.1, "launch waited for the device"
    fa._slot.uploaded.synchronize()
    assert not fa._slot.computed.query(), "the copy in waited for the stalled compute"

    # Download stream stalled (behind A's copy out): B and C still compute, their
    # copies out wait.
    _busy(runner._download)
    fb = runner.launch(0, [b[0]], [b[1]], [b[2]])
    fc = runner.launch(0, [c[0]], [c[1]], [c[2]])  # eager: above every graph bucket
    fc._slot.computed.synchronize()
    assert not fb._slot.downloaded.query() and not fc._slot.downloaded.query()
    for flight, ref in zip((fc, fa, fb), (want[2], want[0], want[1]), strict=True):
        out = flight.wait().out
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), name
        flight.release()


def test_small_buckets_copying_inside_their_graph_give_the_copy_path_bits(served, monkeypatch):
    """Buckets up to FUSED_ROWS tokens copy in and out inside their graph (one replay);
    each batch gets the bits the three-stream path gives it, also with eager batches
    (which grow the slots' other host buffers) and NaN rows in between."""
    name, preset, experts, _, server = served
    fused = _runner(server)
    monkeypatch.setattr(runner_module, "FUSED_ROWS", 0)
    plain = _runner(server)
    assert fused.graphs.fused(FUSED_ROWS) and not plain.graphs.fused(1)
    rnd = random.Random(11)
    sizes = [1, 2, 3, 5, 8, 13, 16, 31, 33, 64, 65, 1100]
    for s in range(30):
        m = rnd.choice(sizes) if s >= len(sizes) else sizes[s]
        x, i, w = make_case(preset, experts, m, 500 + s, nan=s % 7 == 3)[1]
        got, want = fused.run(0, [x], [i], [w]), plain.run(0, [x], [i], [w])
        assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16)), (name, m)
        assert torch.equal(got[1], want[1]) and bool(got[1].any()) == (s % 7 == 3)


def test_many_flights_through_three_slots_keep_their_buffers(served):
    """Launch, wait and release in a rolling window of three (graph buckets and eager,
    slots reused many times), every result equal to the same batch run alone."""
    name, preset, experts, full, server = served
    runner = _runner(server)
    rnd = random.Random(10)
    batches = []
    for s in range(30):
        reqs = [
            make_case(preset, experts, rnd.choice(SIZES[name]), 100 * s + j)[1]
            for j in range(rnd.randint(1, 3))
        ]
        batches.append(tuple(list(t) for t in zip(*reqs, strict=True)))
    want = []
    for xs, ids, ws in batches:
        out, bad = runner.run(0, xs, ids, ws)
        want.append((out.clone(), bad.clone()))
        parts = zip(xs, ids, ws, strict=True)
        ref = torch.cat(
            [reference_forward(full, x.cuda(), i.cuda(), w.cuda()) for x, i, w in parts]
        )
        assert relative_error(out, ref.cpu()) <= 1e-2, (name, [x.shape[0] for x in xs])
    flights, results = [], []
    for xs, ids, ws in batches:
        if len(flights) == runner.depth:
            f = flights.pop(0)
            r = f.wait()
            results.append((r.out.clone(), r.bad.clone()))
            f.release()
        flights.append(runner.launch(0, xs, ids, ws))
    for f in flights:
        r = f.wait()
        results.append((r.out.clone(), r.bad.clone()))
        f.release()
    for (out, bad), (ref, ref_bad) in zip(results, want, strict=True):
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), name
        assert torch.equal(bad, ref_bad)
