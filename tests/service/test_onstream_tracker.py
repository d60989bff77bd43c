"""The tracker of calls queued on callers' streams (client/onstream.py), on real shm slots of
a real shard: a call rung from elsewhere (here by this host, as a caller's stream rings an
on-stream call) is finished by the tracker. Answered: the slot goes back and the shard's
Timing is kept. Refused: its error is raised by `synchronize`, once. Not answered by its
deadline: DEADLINE_EXCEEDED then, not when the shard answers, and the lease dropped. The
CUDA side (the stream's stores, waits and copies, a stream released by the tracker) is
tests/gpu/test_cuda_onstream.py."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from conftest import hidden, lease_shm_slots, routing, shard_config, slowed_launch

from expertd import dataplane as dp
from expertd.client import ShardCallError
from expertd.client.core import bf16_bits
from expertd.client.onstream import Tracker
from expertd.client.replicas import Endpoint
from expertd.server.app import BackgroundServer
from expertd.server.bank import ExpertBank

pytestmark = pytest.mark.skipif(not dp.available(), reason="needs Linux memfd, futex, fd passing")


@pytest.fixture(scope="module")
def bank():
    return ExpertBank.load(shard_config(0, num_shards=1), progress=lambda _m: None)


def _ring(slot, x, ids, w, timeout: float = 10.0) -> None:
    slot.start(0, bf16_bits(x), None, ids.numpy(), w.numpy(), timeout, notify=False)


def test_tracker_finishes_answered_refused_and_late_calls(bank):
    gen = torch.Generator().manual_seed(4)
    x = hidden(3, gen)
    ids, w = routing(3, gen)
    with BackgroundServer(shard_config(0, num_shards=1), bank=bank) as server:
        plane, _ = lease_shm_slots(server.address)
        ep = Endpoint(server.address, None, None)
        tracker = Tracker()
        try:
            # answered: the slot comes back, the shard's Timing is kept
            slot = plane.acquire()
            _ring(slot, x, ids, w)
            tracker.add(slot, time.monotonic() + 10, ep, 0, [0])
            tracker.synchronize(timeout=10)
            assert ep.last_timing["batch_tokens"] == 3 and slot.ctl.done_seq == slot.seq
            assert not slot.held and tracker.pending == 0

            # refused by the shard: raised once, by synchronize
            bad = x.clone()
            bad[1, 7] = float("inf")
            slot = plane.acquire()
            _ring(slot, bad, ids, w)
            tracker.add(slot, time.monotonic() + 10, ep, 0, [0])
            with pytest.raises(ShardCallError) as info:
                tracker.synchronize(timeout=10)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "Inf" in str(info.value)
            tracker.synchronize(timeout=10)  # nothing left to raise

            # not answered by its deadline: failed then, done_seq stored, lease dropped
            with slowed_launch(server, 2.0):
                slot = plane.acquire()
                _ring(slot, x, ids, w)
                t0 = time.monotonic()
                tracker.add(slot, t0 + 0.2, ep, 0, [0])
                with pytest.raises(ShardCallError) as info:
                    tracker.synchronize(timeout=10)
                took = time.monotonic() - t0
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert 0.2 <= took < 1.5, took  # the shard answers after 2 s
            assert slot.lease.closed and not plane.usable()
        finally:
            tracker.close()
            plane.close()
