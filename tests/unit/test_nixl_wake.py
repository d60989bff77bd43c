"""A shard's wake port (expertd.nixl.WakePort): a progress thread in its naps is woken
by a datagram holding a live lease's token and then polls as after any activity; a
datagram holding anything else, or a dropped lease's token, is read and slept
through. A stand-in agent counts the thread's passes (no NIXL needed); the naps are
made long (60 s) so that only a wake-up can explain a pass."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from expertd import nixl


class CountingAgent:
    def __init__(self) -> None:
        self.passes = 0
        self.lock = threading.Lock()

    def get_new_notifs(self):
        with self.lock:
            self.passes += 1
        return {}


def _passes_after(agent: CountingAgent, send, settle_s: float = 0.4) -> int:
    before = agent.passes
    send()
    time.sleep(settle_s)
    return agent.passes - before


@pytest.fixture
def napping(monkeypatch):
    """A progress thread with a wake port, asleep in a 60 s nap once it is quiet."""
    monkeypatch.setattr(nixl.Progress, "HOT_S", 0.02)
    monkeypatch.setattr(nixl.Progress, "NAP_S", 60.0)
    monkeypatch.setattr(nixl.Progress, "MAX_NAP_S", 60.0)
    port = nixl.WakePort("127.0.0.1")
    agent = CountingAgent()
    progress = nixl.Progress(agent, lambda *_: None, "test-nixl-wake", wake_port=port)
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    deadline = time.monotonic() + 10
    while True:  # quiet past HOT_S: in the nap once a pass count holds still
        seen = agent.passes
        time.sleep(0.2)
        if agent.passes == seen:
            break
        assert time.monotonic() < deadline, "the thread never went quiet"
    yield port, agent, progress, lambda data: sender.sendto(data, ("127.0.0.1", port.port))
    progress.stop()
    port.close()
    sender.close()


def test_a_live_token_wakes_the_thread_and_others_do_not(napping):
    port, agent, _progress, send = napping
    token, other = port.new_token(), port.new_token()
    port.drop(other)  # a lease that ended
    assert _passes_after(agent, lambda: send(b"not a token")) == 0
    assert _passes_after(agent, lambda: send(other)) == 0
    assert port.rung == 0
    woke = _passes_after(agent, lambda: send(token))
    assert woke > 1 and port.rung == 1  # awake: polling as after activity, then quiet
    assert _passes_after(agent, lambda: None) == 0  # back in its nap


def test_a_local_wake_still_wakes_a_thread_with_a_port(napping):
    _port, agent, progress, _send = napping
    assert _passes_after(agent, progress._wake.set) >= 1
