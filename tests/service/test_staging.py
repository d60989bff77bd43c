"""Packed staging on CPU: the layout of the one copy in and the one copy back
(server/graphs.py `Layout`), the numpy gather into it and its padding
bookkeeping (server/staging.py), the runner's slots, and batches overlapped
through the real batcher (a CPU runner with two slots takes the same path as a
GPU one: launch on the compute thread, finish on the finisher thread). The
same code on the GPU: tests/gpu/test_cuda_overlap.py."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from conftest import PRESET, hidden, shard_config

from expertd import wire
from expertd.codec import parse_forward_response
from expertd.kernels import reference_forward, relative_error
from expertd.server import batcher as batcher_module
from expertd.server.bank import ExpertBank
from expertd.server.batcher import INLINE_TOKENS, Batcher, BatchPolicy, Job
from expertd.server.graphs import ALIGN, Layout
from expertd.server.metrics import Metrics
from expertd.server.runner import LANE_SLOT, BatchRunner
from expertd.server.staging import HostStaging, Result, SlotPool
from expertd.server.validate import Limits, RequestError, parse_forward
from expertd.v1 import expertd_pb2 as pb

H = PRESET.hidden_size


def request(m: int, k: int, gen: torch.Generator, *, int64=False, bf16_w=False, experts=64):
    x = hidden(m, gen)
    ids = torch.randint(-1, experts, (m, k), generator=gen, dtype=torch.int32)
    w = torch.rand((m, k), generator=gen)
    return x, ids.long() if int64 else ids, w.bfloat16() if bf16_w else w


def old_gather(xs, ids, ws, rows: int, width: int):
    """The gather the runner did before packing: torch.cat and padded copies."""
    x = torch.cat(xs)
    rid = torch.full((rows, width), -1, dtype=torch.int32)
    rw = torch.zeros((rows, width), dtype=torch.float32)
    row = 0
    for i, w in zip(ids, ws, strict=True):
        n, k = i.shape
        rid[row : row + n, :k] = i
        rw[row : row + n, :k] = w
        row += n
    return x, rid, rw


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a.view(torch.uint8) == b.view(torch.uint8)).all())


def packed(host: HostStaging, layout: Layout):
    """What the device sees after the one copy in: the input buffer's prefix."""
    x, ids, w = layout.inputs(host.input)
    return x, ids, w


# -- Layout ----------------------------------------------------------------------------


@pytest.mark.parametrize("rows,k,h", [(1, 8, 512), (3, 1, 256), (1024, 8, 4096), (7, 64, 512)])
def test_layout_regions_are_aligned_and_one_prefix_moves_a_batch(rows, k, h):
    lay = Layout(rows, k, h)
    assert lay.weights_offset % ALIGN == 0 and lay.x_offset % ALIGN == 0
    assert lay.out_offset % ALIGN == 0
    assert lay.weights_offset >= 4 * rows * k and lay.x_offset >= lay.weights_offset + 4 * rows * k
    assert lay.in_bytes == lay.x_offset + 2 * rows * h == lay.in_prefix(rows)
    assert lay.out_bytes == lay.out_offset + 2 * rows * h == lay.out_prefix(rows)
    for m in (0, 1, rows):  # every row's routes go in, x only up to m
        assert lay.in_prefix(m) == lay.x_offset + 2 * m * h
        assert lay.out_prefix(m) == lay.out_offset + 2 * m * h
    with pytest.raises(ValueError, match="do not fit"):
        lay.in_prefix(rows + 1)
    with pytest.raises(ValueError, match="uint8 buffer"):
        lay.inputs(torch.zeros(lay.in_bytes - 1, dtype=torch.uint8))


def test_layout_views_do_not_overlap():
    lay = Layout(5, 3, 256)
    buf = torch.zeros(lay.in_bytes, dtype=torch.uint8)
    x, ids, w = lay.inputs(buf)
    x.fill_(1.0)
    ids.fill_(-1)
    w.fill_(2.0)
    assert bool((x == 1.0).all()) and bool((ids == -1).all()) and bool((w == 2.0).all())
    out_buf = torch.zeros(lay.out_bytes, dtype=torch.uint8)
    out, bad = lay.outputs(out_buf)
    out.fill_(3.0)
    bad.fill_(True)
    assert bool((out == 3.0).all()) and bool(bad.all())


# -- gather ------------------------------------------------------------------------------

MIXES = {
    "one request": [(1, 8, {})],
    "mixed top_k and dtypes": [
        (3, 8, {}),
        (0, 8, {}),
        (5, 2, {"int64": True}),
        (1, 8, {"bf16_w": True}),
        (4, 1, {"int64": True, "bf16_w": True}),
    ],
    "many small": [(1, k % 8 + 1, {}) for k in range(12)],
}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("extra_rows", [0, 3])  # 0: eager layout (rows = M); 3: a graph bucket
def test_pack_matches_the_old_gather_bit_for_bit(mix, extra_rows):
    gen = torch.Generator().manual_seed(1)
    reqs = [request(m, k, gen, **kw) for m, k, kw in MIXES[mix]]
    xs, ids, ws = (list(t) for t in zip(*reqs, strict=True))
    m = sum(x.shape[0] for x in xs)
    width = 8
    lay = Layout(m + extra_rows, width, H)
    host = HostStaging(pin=False, in_bytes=lay.in_bytes, out_bytes=lay.out_bytes)
    host.input.fill_(0xAB)  # garbage where nothing is written
    assert host.pack(lay, xs, ids, ws) == m
    x, rid, rw = packed(host, lay)
    ox, oid, ow = old_gather(xs, ids, ws, m + extra_rows, width)
    assert same_bits(x[:m], ox)
    assert same_bits(rid, oid) and same_bits(rw, ow)  # padding rows: no route, weight 0


def reference_pack(layout: Layout, xs, ids, ws):
    _, rid, rw = old_gather(xs, ids, ws, layout.rows, layout.top_k)
    return torch.cat(xs), rid, rw


def test_padding_bookkeeping_over_a_random_sequence_of_batches():
    """Layouts share one buffer (as a slot's buckets do); after every pack the
    routes and weights are exactly those of a fresh gather."""
    gen = torch.Generator().manual_seed(2)
    rnd = random.Random(2)
    layouts = [Layout(r, 8, H) for r in (1, 2, 4, 8, 16)] + [Layout(5, 3, H)]
    host = HostStaging(pin=False)
    for _ in range(150):
        lay = rnd.choice(layouts)
        sizes, left = [], rnd.randint(0, lay.rows)
        while left:
            sizes.append(rnd.randint(1, left))
            left -= sizes[-1]
        reqs = [request(s, rnd.randint(1, lay.top_k), gen) for s in sizes] or [request(0, 1, gen)]
        xs, ids, ws = (list(t) for t in zip(*reqs, strict=True))
        m = host.pack(lay, xs, ids, ws)
        x, rid, rw = packed(host, lay)
        rx, rrid, rrw = reference_pack(lay, xs, ids, ws)
        assert same_bits(x[:m], rx) and same_bits(rid, rrid) and same_bits(rw, rrw)


def test_padding_rows_are_written_once_not_per_batch():
    gen = torch.Generator().manual_seed(3)
    lay = Layout(8, 8, H)
    host = HostStaging(pin=False)
    host.pack(lay, *([t] for t in request(6, 8, gen)))
    host.pack(lay, *([t] for t in request(2, 8, gen)))  # rows 2..5 reset
    _, rid, _ = packed(host, lay)
    assert bool((rid[2:] == -1).all())
    rid[7, 0] = 99  # behind the packer's back: a row it knows it left as "no route"
    host.pack(lay, *([t] for t in request(2, 8, gen)))
    assert int(rid[7, 0]) == 99  # not rewritten: padding costs nothing batch after batch
    host.pack(Layout(4, 8, H), *([t] for t in request(4, 8, gen)))  # another layout wrote here
    host.pack(lay, *([t] for t in request(1, 8, gen)))
    assert bool((rid[1:] == -1).all())  # so every padding row was reset


def test_pack_refuses_what_does_not_fit():
    gen = torch.Generator().manual_seed(4)
    host = HostStaging(pin=False)
    with pytest.raises(ValueError, match="does not fit"):
        host.pack(Layout(2, 8, H), *([t] for t in request(3, 8, gen)))
    with pytest.raises(ValueError, match="does not fit"):
        host.pack(Layout(4, 2, H), *([t] for t in request(3, 4, gen)))


def test_result_reads_the_output_prefix():
    """What comes back in the one copy out: [bad | out] in the layout, read as views."""
    lay = Layout(8, 8, H)
    host = HostStaging(pin=False, in_bytes=lay.in_bytes, out_bytes=lay.out_bytes)
    out, bad = lay.outputs(host.output)  # here the device's copy lands
    gen = torch.Generator().manual_seed(5)
    want = hidden(8, gen)
    out.copy_(want)
    bad.copy_(torch.tensor([0, 1, 0, 0, 1, 0, 0, 0], dtype=torch.bool))
    r = host.result(lay, 5)
    assert same_bits(r.out, want[:5]) and r.bad.tolist() == [False, True, False, False, True]
    assert r.out_bytes.shape == (5, 2 * H) and r.out_bytes.dtype == np.uint8
    assert np.shares_memory(r.out_bytes, host.output.numpy())  # no copy until the response
    empty = Result.of(torch.zeros((0, H), dtype=torch.bfloat16), torch.zeros(0, dtype=torch.bool))
    assert empty.out.shape == (0, H) and empty.bad.shape == (0,)


# -- slots --------------------------------------------------------------------------------


def test_slot_pool_hands_out_each_slot_once():
    pool = SlotPool(2)
    a, b = pool.acquire(), pool.acquire()
    assert {a, b} == {0, 1} and pool.free == 0
    with pytest.raises(RuntimeError, match="all 2 slots"):
        pool.acquire()
    pool.release(a)
    with pytest.raises(RuntimeError, match="not held"):
        pool.release(a)
    with pytest.raises(RuntimeError, match="not held"):
        pool.release(5)
    assert pool.acquire() == a
    with pytest.raises(ValueError):
        SlotPool(0)


def test_slot_pool_from_many_threads():
    pool = SlotPool(3)
    held, errors, lock = set(), [], threading.Lock()

    def work():
        for _ in range(300):
            try:
                s = pool.acquire()
            except RuntimeError:
                continue
            with lock:
                if s in held:
                    errors.append(s)
                held.add(s)
            with lock:
                held.discard(s)
            pool.release(s)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and pool.free == 3


# -- the runner on CPU ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def bank0():
    return ExpertBank.load(shard_config(0), progress=lambda _m: None)


def batch(gen, spec):
    reqs = [request(m, k, gen, experts=8, **kw) for m, k, kw in spec]
    return tuple(list(t) for t in zip(*reqs, strict=True))


@pytest.mark.parametrize("depth", [1, 2])
def test_runner_results_are_those_of_the_old_path(bank0, depth):
    runner = BatchRunner(bank0, depth=depth)
    gen = torch.Generator().manual_seed(6)
    backend, state = bank0.backend, bank0.state(0)
    for spec in (MIXES["one request"], MIXES["mixed top_k and dtypes"], [(0, 8, {})]):
        xs, ids, ws = batch(gen, spec)
        out, bad = runner.run(0, xs, ids, ws)
        m = sum(x.shape[0] for x in xs)
        if len(xs) == 1:
            want = backend.forward(state, xs[0], ids[0], ws[0].float())
        else:
            want = backend.forward(state, *old_gather(xs, ids, ws, m, max(i.shape[1] for i in ids)))
        assert same_bits(out, want) and bad.shape == (m,) and not bool(bad.any())


def test_runner_flights_in_two_slots(bank0):
    runner, sequential = BatchRunner(bank0, depth=2), BatchRunner(bank0, depth=1)
    gen = torch.Generator().manual_seed(7)
    a, b, c = (batch(gen, [(4, 8, {}), (3, 2, {})]) for _ in range(3))
    a[0][1] = a[0][1].clone()
    a[0][1][2, 5] = float("nan")
    fa, fb = runner.launch(0, *a), runner.launch(0, *b)
    assert not fa.done and not fb.done  # off the GPU the forward runs in wait()
    with pytest.raises(RuntimeError, match="all 2 slots"):
        runner.launch(0, *c)
    rb, ra = fb.wait(), fa.wait()  # out of order
    fb.release()
    out_c, _ = runner.run(0, *c)  # a slot is free again
    fa.release()
    fa.release()  # twice: harmless
    early = runner.launch(0, *c)
    early.release()
    with pytest.raises(RuntimeError, match="released before"):
        early.wait()
    for result, args in ((ra, a), (rb, b)):
        out, bad = sequential.run(0, *args)
        assert same_bits(result.out, out) and result.bad.tolist() == bad.tolist()
    assert ra.bad.tolist() == [False] * 6 + [True]  # the second request's row 2
    assert same_bits(out_c, sequential.run(0, *c)[0])


# -- overlapped batches through the batcher ------------------------------------------------


def forward_request(m, k, seed, *, int64=False, bf16_w=False, nan=False):
    gen = torch.Generator().manual_seed(seed)
    x, ids, w = request(m, k, gen, int64=int64, bf16_w=bf16_w, experts=8)
    if nan:
        x = x.clone()
        x[m - 1, 3] = float("inf")
    req = pb.ForwardRequest(
        layer=seed % 2,
        request_id=seed,
        hidden_states=wire.encode(x),
        topk_ids=wire.encode(ids),
        topk_weights=wire.encode(w),
    )
    return req, (x, ids, w)


def test_batches_overlapped_in_two_slots_answer_every_request(bank0, full_layers):
    """Many concurrent requests of mixed sizes and both layers through the real batcher
    over a two-slot runner: every answer is its own request's (float64 reference), a
    non-finite request fails alone, and two batches were in flight at once."""
    runner = BatchRunner(bank0, depth=2)
    in_flight, peak = [0], [0]
    launch, lock = runner.launch, threading.Lock()

    def counting_launch(*args):
        flight = launch(*args)
        with lock:
            in_flight[0] = runner.depth - runner._slots.free
            peak[0] = max(peak[0], in_flight[0])
        return flight

    runner.launch = counting_launch
    rnd = random.Random(8)
    cases = [
        forward_request(
            max(rnd.choice([0, 1, 2, 3, 7, 16, 40]), seed in (11, 29)),
            rnd.randint(1, 8),
            seed,
            int64=seed % 5 == 0,
            bf16_w=seed % 7 == 0,
            nan=seed in (11, 29),
        )
        for seed in range(48)
    ]
    limits = Limits(max_tokens=1024, max_top_k=64)

    async def go():
        compute = ThreadPoolExecutor(1, thread_name_prefix="test-compute")
        batcher = Batcher(runner, compute, Metrics(), BatchPolicy(max_batch_requests=4))
        batcher.start()
        loop = asyncio.get_running_loop()
        jobs = []
        for req, _ in cases:
            args = parse_forward(req, bank0.info, limits, bank0.has_layer)
            jobs.append(
                Job(args, None, time.perf_counter_ns(), loop.create_future(), req.request_id)
            )
            batcher.submit(jobs[-1])
        results = await asyncio.gather(*(j.future for j in jobs), return_exceptions=True)
        assert batcher.computing == 0
        await batcher.stop()
        compute.shutdown()
        return results

    results = asyncio.run(go())
    assert peak[0] == 2
    for (req, (x, ids, w)), res in zip(cases, results, strict=True):
        if req.request_id in (11, 29):
            assert "is inf" in str(res)
            continue
        assert isinstance(res, bytes), res
        reply = parse_forward_response(res)
        assert reply.request_id == req.request_id
        out = wire.decode(reply.output, "output")
        ref = reference_forward(full_layers[req.layer], x, ids, w.float())
        assert out.shape == x.shape and relative_error(out, ref) <= 1e-2


def test_runner_refuses_a_pipeline_depth_below_one(bank0):
    with pytest.raises(ValueError, match="pipeline depth must be at least 1"):
        BatchRunner(bank0, depth=0)


def test_serve_takes_the_pipeline_depth_from_its_flag_and_environment(monkeypatch):
    from expertd.cli import build_parser

    args = build_parser().parse_args(["serve", "--synthetic", "small", "--pipeline-depth", "1"])
    assert args.pipeline_depth == 1
    monkeypatch.setenv("EXPERTD_PIPELINE_DEPTH", "3")
    assert build_parser().parse_args(["serve", "--synthetic", "small"]).pipeline_depth == 3


def _count_paths(monkeypatch) -> tuple[list[int], list[int]]:
    """-> (batches run on the loop, batches sent to the compute thread), as they come."""
    here, threaded = [], []
    run_here, launch_there = Batcher._run_here, Batcher._launch
    monkeypatch.setattr(
        Batcher, "_run_here", lambda self, jobs: (here.append(len(jobs)), run_here(self, jobs))
    )
    monkeypatch.setattr(
        Batcher,
        "_launch",
        lambda self, jobs: (threaded.append(len(jobs)), launch_there(self, jobs))[1],
    )
    return here, threaded


def _one_at_a_time(runner, bank, cases) -> list:
    """Each request of `cases` submitted alone (a lone batch) to a fresh batcher ->
    its serialized answer or its exception."""
    limits = Limits(max_tokens=1024, max_top_k=64)

    async def go():
        compute = ThreadPoolExecutor(1, thread_name_prefix="test-compute")
        batcher = Batcher(runner, compute, Metrics(), BatchPolicy())
        batcher.start()
        loop = asyncio.get_running_loop()
        results = []
        for req, _ in cases:
            args = parse_forward(req, bank.info, limits, bank.has_layer)
            job = Job(args, None, time.perf_counter_ns(), loop.create_future(), req.request_id)
            batcher.submit(job)
            results.append(await asyncio.gather(job.future, return_exceptions=True))
        await batcher.stop()
        compute.shutdown()
        return [r[0] for r in results]

    return asyncio.run(go())


def test_small_batches_run_on_the_loop_and_a_failure_reaches_only_its_callers(
    bank0, full_layers, monkeypatch
):
    """The batcher's inline path (server/batcher.py `_run_here`, a GPU's small lone
    batches), allowed here on CPU: answers are the reference's, a launch that fails
    fails its own batch's callers only, and larger batches still take the compute
    thread."""
    runner = BatchRunner(bank0, depth=2)
    monkeypatch.setattr(
        Batcher, "_here", lambda self, tokens: tokens <= INLINE_TOKENS and self.computing == 0
    )
    here, threaded = _count_paths(monkeypatch)
    launch, failing = runner.launch, {3}

    def launch_or_fail(layer, xs, ids, ws, outs=None, bells=None):
        if xs[0].shape[0] in failing:
            raise RuntimeError("device fault (simulated)")
        return launch(layer, xs, ids, ws)

    runner.launch = launch_or_fail
    cases = [forward_request(m, 8, seed) for seed, m in enumerate([1, 3, 16, 2, 40, 1])]
    results = _one_at_a_time(runner, bank0, cases)
    assert here == [1, 1, 1, 1, 1] and threaded == [1]  # 40 tokens: the compute thread
    assert runner._slots.free == 2
    for (req, (x, ids, w)), res in zip(cases, results, strict=True):
        if x.shape[0] in failing:
            assert isinstance(res, RuntimeError) and "simulated" in str(res)
            continue
        out = wire.decode(parse_forward_response(res).output, "output")
        ref = reference_forward(full_layers[req.layer], x, ids, w.float())
        assert relative_error(out, ref) <= 1e-2


@pytest.mark.parametrize("limit_s, here_want", [(60.0, [1, 1, 1]), (1e-9, [])])
def test_a_cpu_shard_runs_small_batches_on_the_loop_while_they_are_short(
    bank0, full_layers, monkeypatch, limit_s, here_want
):
    """On a CPU the batcher runs a lone small batch on its loop once its last small
    batches each took at most INLINE_CPU_MAX_S (the first has no history: the compute
    thread); one past INLINE_TOKENS, or any while they are slower, takes the compute
    thread. The answers are the reference's either way."""
    monkeypatch.setattr(batcher_module, "INLINE_CPU_MAX_S", limit_s)
    runner = BatchRunner(bank0, depth=1)
    here, threaded = _count_paths(monkeypatch)
    cases = [forward_request(m, 8, seed) for seed, m in enumerate([1, 2, 3, 40, 1])]
    results = _one_at_a_time(runner, bank0, cases)
    assert here == here_want and len(threaded) == 5 - len(here_want)
    for (req, (x, ids, w)), res in zip(cases, results, strict=True):
        out = wire.decode(parse_forward_response(res).output, "output")
        ref = reference_forward(full_layers[req.layer], x, ids, w.float())
        assert relative_error(out, ref) <= 1e-2


def test_a_lone_call_takes_the_gate_and_a_slot_only_from_an_idle_batcher(bank0):
    """The lane's hold on the batcher (take_lone / give_lone, server/lane.py): the lane's
    runner slot (LANE_SLOT, whose graphs it runs) and the gate while nothing is queued,
    computing or held; a queued job, a lone call holding the gate, or that slot taken,
    sends the next call the general way; every slot comes back."""
    runner = BatchRunner(bank0, depth=2)

    async def go():
        compute = ThreadPoolExecutor(1, thread_name_prefix="test-compute")
        batcher = Batcher(runner, compute, Metrics(), BatchPolicy())
        index = batcher.take_lone()
        assert index == LANE_SLOT and runner.free_slots == 1
        assert batcher.take_lone() is None  # the gate is held (it waits a moment, then no)
        batcher.give_lone(index)
        assert runner.free_slots == 2
        other = runner._slots.acquire()  # a batch in the other slot: the lane runs
        assert other != LANE_SLOT and batcher.take_lone() == LANE_SLOT
        batcher.give_lone(LANE_SLOT)
        runner.give_slot(other)
        assert runner.take_slot(LANE_SLOT)  # a batch in the lane's slot: it declines
        assert batcher.take_lone() is None and runner.free_slots == 1
        runner.give_slot(LANE_SLOT)
        assert runner.free_slots == 2
        loop = asyncio.get_running_loop()
        req, _ = forward_request(2, 8, seed=4)
        limits = Limits(max_tokens=1024, max_top_k=64)
        args = parse_forward(req, bank0.info, limits, bank0.has_layer)
        job = Job(args, None, time.perf_counter_ns(), loop.create_future(), req.request_id)
        batcher.submit(job)  # queued, the loop not started: the batcher is not idle
        assert batcher.take_lone() is None and runner.free_slots == 2
        batcher.start()
        await job.future
        index = batcher.take_lone()  # idle again
        assert index is not None
        batcher.give_lone(index)
        await batcher.stop()
        compute.shutdown()

    asyncio.run(go())
    assert runner.free_slots == 2


def test_an_idle_batcher_answers_a_small_request_in_its_handler(bank0, full_layers, monkeypatch):
    """Batcher.run_now (a gRPC request read on the event loop): where the batcher's own
    loop would run the request as a batch of one on this thread (idle, small, short
    CPU batches lately), it is answered in place with the reference's answer; with a
    request queued, a batch window, a request past INLINE_TOKENS or slow batches
    lately it does nothing (None: the caller queues it); a passed deadline is raised."""
    runner = BatchRunner(bank0, depth=1)
    limits = Limits(max_tokens=1024, max_top_k=64)
    # every batch here counts as short (a loaded machine's 16 tokens may take > 5 ms)
    monkeypatch.setattr(batcher_module, "INLINE_CPU_MAX_S", 60.0)

    async def go():
        compute = ThreadPoolExecutor(1, thread_name_prefix="test-compute")
        batcher = Batcher(runner, compute, Metrics(), BatchPolicy())
        loop = asyncio.get_running_loop()

        def job(m: int, seed: int, deadline=None, queued=False):
            req, inputs = forward_request(m, 8, seed)
            args = parse_forward(req, bank0.info, limits, bank0.has_layer)
            future = loop.create_future() if queued else None
            return Job(args, deadline, time.perf_counter_ns(), future, req.request_id), inputs

        first, _ = job(1, 0)
        assert batcher.run_now(first) is None  # no history of short CPU batches yet
        batcher._small.add(1e-3)
        results = []
        for seed, m in enumerate([1, 5, INLINE_TOKENS]):
            j, inputs = job(m, seed)
            reply = batcher.run_now(j)
            assert reply is not None
            results.append((j, inputs, reply))
        assert batcher.run_now(job(INLINE_TOKENS + 1, 7)[0]) is None
        with pytest.raises(RequestError, match="deadline passed"):
            batcher.run_now(job(1, 8, deadline=time.monotonic() - 1)[0])
        waiting, _ = job(2, 9, queued=True)
        batcher.submit(waiting)  # queued (the loop not started): not idle
        assert batcher.run_now(job(1, 10)[0]) is None
        batcher.start()
        await waiting.future
        assert batcher.run_now(job(1, 11)[0]) is not None  # idle again
        windowed = Batcher(runner, compute, Metrics(), BatchPolicy(window_s=1e-3))
        windowed._small.add(1e-3)
        assert windowed.run_now(job(1, 12)[0]) is None
        monkeypatch.setattr(batcher_module, "INLINE_CPU_MAX_S", 1e-9)
        assert batcher.run_now(job(1, 13)[0]) is None  # its small batches were slower
        await batcher.stop()
        compute.shutdown()
        return results

    for j, (x, ids, w), reply in asyncio.run(go()):
        assert parse_forward_response(reply).request_id == j.request_id
        out = wire.decode(parse_forward_response(reply).output, "output")
        ref = reference_forward(full_layers[j.args.layer], x, ids, w.float())
        assert relative_error(out, ref) <= 1e-2
    assert runner.free_slots == 1
