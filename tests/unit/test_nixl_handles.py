"""The NIXL transfer handles a slot keeps by shape (expertd.nixl.Handles): two real
agents in one process, host memory, UCX. Every call's bytes and notification
arrive whether its handle was kept, made anew or evicted; at most KEEP are kept."""

from __future__ import annotations

import time

import numpy as np
import pytest

from expertd import nixl

pytestmark = pytest.mark.skipif(not nixl.available(), reason="NIXL is not importable")

SIZE = 1 << 16


@pytest.fixture
def pair():
    a, b = nixl.make_agent("test-a"), nixl.make_agent("test-b")
    src, dst = np.zeros(SIZE, np.uint8), np.zeros(SIZE, np.uint8)
    a.register_memory([(src.ctypes.data, SIZE, 0, "")], nixl.HOST)
    b.register_memory([(dst.ctypes.data, SIZE, 0, "")], nixl.HOST)
    peer = a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    progress = nixl.Progress(a, lambda *_: None, "test-nixl-handles")
    progress.stop()  # the test drives the agent itself
    yield a, b, src, dst, peer, progress


def _write(agent, src, dst, peer, n):
    def make():
        local = agent.get_xfer_descs([(src.ctypes.data, n, 0)], nixl.HOST)
        remote = agent.get_xfer_descs([(dst.ctypes.data, n, 0)], nixl.HOST)
        return agent.initialize_xfer("WRITE", local, remote, peer, b"")

    return make


def _receive(b, progress, want: int) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + 10
    while len(got) < want or progress._posted:
        progress.poll()
        for messages in b.get_new_notifs().values():
            got.extend(messages)
        assert time.monotonic() < deadline, f"{len(got)} of {want} notifications"
    return got


def test_kept_handles_carry_each_call_and_stay_bounded(pair):
    a, b, src, dst, peer, progress = pair
    handles = nixl.Handles(progress)
    done = []
    sizes = [64, 128, 64, 256, 512, 1024, 2048, 64, 128, 64]  # more shapes than KEEP
    for i, n in enumerate(sizes):
        src[:n] = i + 1
        handles.send(n, _write(a, src, dst, peer, n), peer, b"call %d" % i, done.append)
        assert _receive(b, progress, 1) == [b"call %d" % i]
        assert (dst[:n] == i + 1).all(), f"call {i}: the bytes of this call"
        assert len(handles._kept) <= nixl.Handles.KEEP
    assert done == ["DONE"] * len(sizes)
    assert not progress._posted
    handles.close()
    assert not handles._kept


def test_a_shape_posted_again_before_its_last_transfer_is_seen_done(pair):
    a, b, src, dst, peer, progress = pair
    handles = nixl.Handles(progress)
    done = []
    make = _write(a, src, dst, peer, 256)
    for i in range(5):  # no poll between: a busy kept handle gets a fresh one
        handles.send(256, make, peer, b"again %d" % i, done.append)
    got = _receive(b, progress, 5)
    assert sorted(got) == sorted(b"again %d" % i for i in range(5))
    assert done == ["DONE"] * 5
    assert len(handles._kept) == 1
    handles.close()


def test_a_pacing_thread_learns_the_gap_between_calls():
    """A shard's progress thread that keeps pace records how long it was quiet before
    each call came; calls spaced by 6 ms teach it a gap of at least half that (its own
    thread may be late to go quiet on a busy machine), a transfer of its own (an
    answer's WRITE) posted after a shorter quiet time does not count, and one that
    does not keep pace records none."""
    a, b = nixl.make_agent("test-pace-a"), nixl.make_agent("test-pace-b")
    src, dst = np.zeros(SIZE, np.uint8), np.zeros(SIZE, np.uint8)
    b.register_memory([(src.ctypes.data, SIZE, 0, "")], nixl.HOST)
    a.register_memory([(dst.ctypes.data, SIZE, 0, "")], nixl.HOST)
    peer = a.add_remote_agent(b.get_agent_metadata())
    back = b.add_remote_agent(a.get_agent_metadata())
    got: list[bytes] = []
    pacing = nixl.Progress(b, lambda _peer, m: got.append(m), "test-pace", keep_pace=True)
    plain = nixl.Progress(a, lambda *_: None, "test-plain")
    try:
        assert plain.gaps is None
        for i in range(8):
            a.send_notif(peer, b"call %d" % i)
            deadline = time.monotonic() + 10
            while len(got) <= i:
                assert time.monotonic() < deadline, f"call {i} not seen"
                time.sleep(1e-4)
            end = time.monotonic() + 6e-3
            while time.monotonic() < end:  # the caller's own work between two layers
                pass
        a.send_notif(peer, b"last call")
        deadline = time.monotonic() + 10
        while len(got) < 9:
            assert time.monotonic() < deadline, "the last call not seen"
            time.sleep(1e-4)
        time.sleep(5e-4)  # quiet for less than the gap, then an answer's WRITE of its own
        done: list[str] = []
        pacing.send(_write(b, src, dst, back, 64)(), back, b"answer", done.append)
        deadline = time.monotonic() + 10
        while not done:
            assert time.monotonic() < deadline, "the answer's WRITE did not complete"
            time.sleep(1e-4)
        assert done == ["DONE"]
        low = pacing.gaps.low()
        assert low >= 3e-3, f"learned gap {low * 1e3:.2f} ms"
    finally:
        pacing.stop()
        plain.stop()
