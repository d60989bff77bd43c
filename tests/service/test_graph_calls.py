"""Calls captured in a caller's CUDA graph (client/onstream.py `GraphCalls`, FLAG_GRAPH), on
real shm slots of a real shard, each replay rung from this host as a replaying stream rings
it: the same req_seq every time, done_seq cleared before it. The shard takes every replay
(it sets req_seq back to 0) and answers each as a plain call would; a refused replay
releases the caller and its error is recorded by the watch; a replay not answered by its
deadline, or whose shard is gone, is released by the watch. The CUDA side (the graph's
copies, stores and waits) is tests/gpu/test_cuda_graph_calls.py."""

from __future__ import annotations

import time

import grpc
import pytest
from conftest import hidden, lease_shm_slots, routing, shard_config, slowed_launch

from expertd import dataplane as dp
from expertd.client import ShardCallError
from expertd.client.core import bf16_bits
from expertd.client.onstream import GraphCalls
from expertd.client.replicas import Endpoint
from expertd.client.shm import ShmChannel, fill_rows
from expertd.server.app import BackgroundServer
from expertd.server.bank import ExpertBank

pytestmark = pytest.mark.skipif(not dp.available(), reason="needs Linux memfd, futex, fd passing")

import torch  # noqa: E402  (after the skip: the module needs nothing else from it)


@pytest.fixture(scope="module")
def bank():
    return ExpertBank.load(shard_config(0, num_shards=1), progress=lambda _m: None)


def _capture(slot, m: int, k: int, timeout: float = 10.0) -> None:
    """The header, stored once when a call is captured."""
    ctl = slot.ctl
    ctl.layer, ctl.m, ctl.k = 0, m, k
    ctl.flags = dp.FLAG_STREAM | dp.FLAG_GRAPH
    ctl.timeout_us = int(timeout * 1e6)
    ctl.span_id = 0


def _replay(slot, x, ids, w, wait: bool = True) -> None:
    """What a replay's stream stores, in its order; then its wait for done_seq."""
    ctl = slot.ctl
    ctl.done_seq = 0
    fill_rows(slot, bf16_bits(x), None, ids.numpy(), w.numpy())
    ctl.req_seq = dp.GRAPH_SEQ
    slot.wake()
    end = time.monotonic() + 10
    while wait and ctl.done_seq != dp.GRAPH_SEQ:
        assert time.monotonic() < end, "the shard did not answer the replay"
        time.sleep(0.0005)


def _plain(plane: ShmChannel, x, ids, w) -> torch.Tensor:
    slot = plane.acquire()
    try:
        slot.start(0, bf16_bits(x), None, ids.numpy(), w.numpy(), 10.0, notify=False)
        assert slot.wait(time.monotonic() + 10)
        return torch.from_numpy(slot.result().copy())
    finally:
        slot.release()


def test_every_replay_is_taken_and_answered_as_a_plain_call(bank):
    gen = torch.Generator().manual_seed(5)
    with BackgroundServer(shard_config(0, num_shards=1), bank=bank) as server:
        plane, kept = lease_shm_slots(server.address, kept=2)
        try:
            slot = kept[0]
            assert slot.held and plane.acquire() is not kept[0]
            _capture(slot, 3, 8)
            for _ in range(4):  # the same req_seq each time: the shard clears it as it takes it
                x = hidden(3, gen)
                ids, w = routing(3, gen)
                _replay(slot, x, ids, w)
                assert slot.ctl.status == 0 and slot.ctl.req_seq == 0
                got = torch.from_numpy(slot.out[: 3 * x.shape[1]].reshape(3, -1).copy())
                assert torch.equal(got, _plain(plane, x, ids, w))
        finally:
            plane.close()


def test_the_watch_records_refusals_and_releases_late_or_orphaned_replays(bank):
    gen = torch.Generator().manual_seed(6)
    x = hidden(2, gen)
    ids, w = routing(2, gen)
    calls = GraphCalls()
    with BackgroundServer(shard_config(0, num_shards=1), bank=bank) as server:
        plane, kept = lease_shm_slots(server.address, kept=2)
        ep = Endpoint(server.address, None, None)
        try:
            slot = kept[0]
            _capture(slot, 2, 8, timeout=0.2)
            calls.add(slot, ep, 0, [0, 1], timeout=0.2)

            # refused: the shard's host releases the replay, the watch records why
            bad = x.clone()
            bad[1, 4] = float("inf")
            _replay(slot, bad, ids, w)
            calls.check()
            with pytest.raises(ShardCallError) as info:
                calls.raise_error()
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "Inf" in str(info.value)
            _replay(slot, x, ids, w)  # then a good one: nothing recorded, Timing kept
            calls.check()
            calls.raise_error()
            assert ep.last_timing["batch_tokens"] == 2

            # not answered by the deadline: released by the watch, the lease ended
            with slowed_launch(server, 2.0):
                t0 = time.monotonic()
                _replay(slot, x, ids, w, wait=False)
                while slot.ctl.done_seq != dp.GRAPH_SEQ:
                    assert time.monotonic() - t0 < 1.5, "the watch did not release the replay"
                    calls.check()
                    time.sleep(0.01)
                took = time.monotonic() - t0
            assert 0.2 <= took < 1.5, took
            with pytest.raises(ShardCallError) as info:
                calls.raise_error()
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert slot.lease.closed
            while slot.ctl.answered_ns < slot.ctl.seen_ns:  # the slowed call ends before the server
                assert time.monotonic() - t0 < 10
                time.sleep(0.01)
        finally:
            calls.close()
            plane.close()

    # the shard gone: a replay of its other kept slot is released as UNAVAILABLE
    with BackgroundServer(shard_config(0, num_shards=1), bank=bank) as server:
        plane, kept = lease_shm_slots(server.address, kept=2)
    calls = GraphCalls()
    try:
        slot = kept[1]
        _capture(slot, 2, 8)
        calls.add(slot, Endpoint(server.address, None, None), 0, [0], timeout=10)
        _replay(slot, x, ids, w, wait=False)
        t0 = time.monotonic()
        while slot.ctl.done_seq != dp.GRAPH_SEQ:
            assert time.monotonic() - t0 < 5, "the watch did not release the replay"
            calls.check()
            time.sleep(0.01)
        with pytest.raises(ShardCallError) as info:
            calls.raise_error()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        calls.close()
        plane.close()


def test_settle_waits_for_the_host_that_answers_after_the_stream_went_on(bank):
    """On a GPU shard the stream releases a replay as soon as its rows are in place, and
    the host's NaN/Inf check may refuse it after: `settle` (in synchronize) waits for the
    host before the watch looks. Emulated here: done_seq stored as a shard's stream
    stores it, the moment the call is taken, while the host is slowed down."""
    gen = torch.Generator().manual_seed(7)
    x = hidden(2, gen)
    ids, w = routing(2, gen)
    bad = x.clone()
    bad[0, 1] = float("nan")
    calls = GraphCalls()
    with BackgroundServer(shard_config(0, num_shards=1), bank=bank) as server:
        plane, kept = lease_shm_slots(server.address, kept=2)
        try:
            slot = kept[0]
            _capture(slot, 2, 8)
            calls.add(slot, Endpoint(server.address, None, None), 0, [0], timeout=10)
            with slowed_launch(server, 0.3):
                _replay(slot, bad, ids, w, wait=False)
                t0 = time.monotonic()
                while slot.ctl.req_seq != 0:  # taken: the shard set it back
                    assert time.monotonic() - t0 < 5
                    time.sleep(0.0005)
                slot.ctl.done_seq = dp.GRAPH_SEQ  # the "stream" goes on at once
                calls.check()
                calls.raise_error()  # nothing yet: the host has not answered
                calls.settle(5)
            assert time.monotonic() - t0 >= 0.25
            calls.check()
            with pytest.raises(ShardCallError) as info:
                calls.raise_error()
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "NaN" in str(info.value) or "nan" in str(info.value)
        finally:
            calls.close()
            plane.close()
