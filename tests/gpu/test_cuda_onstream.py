"""Calls queued on the caller's CUDA stream (ExpertClient(on_stream=True), client/
onstream.py) against a GPU shard process holding every expert: the answers are
gRPC's bit for bit, many calls queue without the host waiting and stay intact, a
refused call's error is raised by the next forward or by synchronize and the shard
keeps serving, a killed shard releases the caller's stream within the deadline.
Skipped without CUDA."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from conftest import cuda_inputs

from expertd.client import ExpertClient, ExpertdError, ShardCallError
from expertd.launcher import start_shard, stop_shards, wait_serving

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

PRESET = "small"


def _start(layers: int = 2, *extra: str):
    procs = [
        start_shard(
            [
                *("--synthetic", PRESET, "--layers", str(layers), "--seed", "7"),
                *("--device", "cuda", *extra),
            ]
        )
    ]
    wait_serving(procs, timeout=300)
    return procs


@pytest.fixture(scope="module")
def shard():
    procs = _start()
    try:
        yield procs[0]
    finally:
        stop_shards(procs)


def _inputs(m: int, seed: int, id_dtype=torch.int64):
    return cuda_inputs(PRESET, m, seed, id_dtype)


def _warm(client: ExpertClient) -> None:
    """The first call leases the slots (on the usual path); later ones go on the stream."""
    x, ids, w = _inputs(1, seed=0)
    client.forward(0, x, ids, w)
    client.synchronize()


def test_on_stream_calls_match_grpc_bit_for_bit(shard):
    torch.cuda.init()
    with (
        ExpertClient([shard.address], on_stream=True) as client,
        ExpertClient([shard.address], transport="grpc") as ref,
    ):
        _warm(client)
        for m in (1, 7, 64, 300):
            for layer in (0, 1):
                for id_dtype in (torch.int64, torch.int32):
                    x, ids, w = _inputs(m, seed=m + layer, id_dtype=id_dtype)
                    got = client.forward(layer, x, ids, w)
                    want = ref.forward(layer, x, ids, w)
                    client.synchronize()
                    assert got.device == x.device and got.dtype == torch.bfloat16
                    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (m, layer)
        x0, ids0, w0 = _inputs(0, seed=4)
        assert client.forward(0, x0, ids0, w0).shape == (0, x0.shape[1])
        client.synchronize()
        stats = client.stats()[shard.address]
        assert stats["transport"] == "cuda-ipc"
        assert stats["stream_calls"] >= 17, stats


def test_many_queued_calls_stay_intact(shard):
    """Forty calls queued back to back, each output read only at the end: the host
    never waited for one (the stream ran them in order through the lease's slots)."""
    with (
        ExpertClient([shard.address], on_stream=True) as client,
        ExpertClient([shard.address], transport="grpc") as ref,
    ):
        _warm(client)
        before = client.stats()[shard.address]["stream_calls"]
        calls = [(_inputs(1 + (i % 5) * 13, seed=100 + i), i % 2) for i in range(40)]
        outs = [client.forward(layer, *inp) for inp, layer in calls]
        client.synchronize()
        assert client.stats()[shard.address]["stream_calls"] - before == 40
        for (inp, layer), got in zip(calls, outs, strict=True):
            want = ref.forward(layer, *inp)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_a_refused_call_raises_later_and_the_shard_keeps_serving(shard):
    with ExpertClient([shard.address], on_stream=True) as client:
        _warm(client)
        x, ids, w = _inputs(4, seed=1)
        bad = x.clone()
        bad[2, 5] = float("nan")
        client.forward(0, bad, ids, w)  # queued: the shard refuses it later
        with pytest.raises(ShardCallError) as info:
            client.synchronize()
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "NaN" in str(info.value)
        ids_bad = ids.clone()
        ids_bad[0, 0] = 10_000
        client.forward(0, x, ids_bad, w)
        time.sleep(0.5)  # answered meanwhile: the next forward raises its error
        with pytest.raises(ShardCallError) as info:
            client.forward(0, x, ids, w)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        out = client.forward(0, x, ids, w)
        client.synchronize()
        assert out.shape == x.shape and bool(torch.isfinite(out.float()).all())


def test_a_killed_shard_releases_the_callers_stream_within_the_deadline():
    procs = _start(1, "--grace", "0")
    try:
        with ExpertClient([procs[0].address], on_stream=True, timeout=3.0) as client:
            _warm(client)
            x, ids, w = _inputs(8, seed=2)
            procs[0].process.kill()
            procs[0].process.wait()
            t0 = time.monotonic()
            # queued on the lease of a shard that is gone (raised by synchronize), or,
            # once the client has seen the lease end, run the usual way (raised here)
            with pytest.raises(ExpertdError) as info:
                client.forward(0, x, ids, w)
                client.synchronize()
            torch.cuda.current_stream().synchronize()  # the stream is not left waiting
            took = time.monotonic() - t0
            assert took < 3.5, f"a dead shard took {took:.1f} s to notice: {info.value}"
    finally:
        stop_shards(procs)


def test_two_shards_each_get_every_token_and_the_sum_matches_grpc():
    """Two shard processes of one expert set each: every shard is sent every token and
    all of its routes and computes the routes to its own experts; the stream sums the
    two answers. At M = 1 (each shard's tile is picked from the same M) the bits are
    gRPC's split path's; at larger M a shard may pick another tile for all M tokens
    than for its part, which rounds differently: the answers agree within bf16."""
    procs = [
        start_shard(
            [
                *("--synthetic", PRESET, "--layers", "1", "--seed", "7"),
                *("--shard", str(s), "--num-shards", "2", "--device", "cuda"),
            ]
        )
        for s in range(2)
    ]
    try:
        wait_serving(procs, timeout=300)
        addresses = [p.address for p in procs]
        with (
            ExpertClient(addresses, on_stream=True) as client,
            ExpertClient(addresses, transport="grpc") as ref,
        ):
            _warm(client)
            for m in (1, 1, 7, 64, 300):
                x, ids, w = _inputs(m, seed=m)
                got = client.forward(0, x, ids, w)
                want = ref.forward(0, x, ids, w)
                client.synchronize()
                if m == 1:
                    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
                else:
                    err = (got.float() - want.float()).norm() / want.float().norm()
                    assert err < 1e-2, (m, float(err))
            stats = client.stats()
            assert all(s["stream_calls"] >= 5 for s in stats.values()), stats
    finally:
        stop_shards(procs)
