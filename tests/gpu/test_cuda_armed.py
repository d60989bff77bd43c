"""Armed calls (server/armed.py): a CUDA caller's on-stream calls at decode sizes run
on the shard's GPU as the caller's stream rings them, the shard's host only keeping
the books. Against a real GPU shard process: the answers are gRPC's bit for bit at
every armed bucket and past them (those run the usual way), the shard's metrics
count the armed calls, and a lease left idle past IDLE_S releases its waits and arms
again at its next call. Skipped without CUDA."""

from __future__ import annotations

import re
import socket
import time
import urllib.request

import pytest
import torch

from expertd import cudamem
from expertd.client import ExpertClient
from expertd.launcher import start_shard, stop_shards, wait_serving
from expertd.server import armed
from expertd.server.synthetic import get_preset

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if cudamem.mps_control_pipe() is None:
    pytest.skip("armed calls need the GPU shared through MPS", allow_module_level=True)

PRESET = "small"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def shard():
    port = _free_port()
    procs = [
        start_shard(
            [
                *("--synthetic", PRESET, "--layers", "2", "--seed", "7"),
                *("--device", "cuda", "--metrics-port", str(port)),
            ]
        )
    ]
    try:
        wait_serving(procs, timeout=300)
        yield procs[0], port
    finally:
        stop_shards(procs)


def _armed_calls(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    found = re.search(rb"^expertd_armed_calls_total (\S+)$", text, re.M)
    assert found, "no expertd_armed_calls_total series"
    return float(found.group(1))


def _inputs(m: int, seed: int):
    p = get_preset(PRESET)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((m, p.hidden_size), device="cuda", generator=gen).bfloat16()
    logits = torch.randn((m, p.num_experts), device="cuda", generator=gen)
    top = logits.topk(p.top_k, dim=1)
    return x, top.indices, torch.softmax(top.values, dim=1)


def _arm(client: ExpertClient) -> None:
    """The first ring-numbered call sets the lease's bank up (captured in a thread)."""
    x, ids, w = _inputs(1, seed=0)
    client.forward(0, x, ids, w)
    client.synchronize()
    time.sleep(3.0)
    for _ in range(3):  # the entries armed from here on
        client.forward(0, x, ids, w)
    client.synchronize()


def test_decode_calls_run_armed_and_match_grpc_bit_for_bit(shard):
    proc, port = shard
    torch.cuda.init()
    with (
        ExpertClient([proc.address], on_stream=True) as client,
        ExpertClient([proc.address], transport="grpc") as ref,
    ):
        _arm(client)
        before = _armed_calls(port)
        calls = 0
        for m in (1, 2, 3, 7, 16, 33, 64):
            for layer in (0, 1):
                x, ids, w = _inputs(m, seed=10 * m + layer)
                got = client.forward(layer, x, ids, w)
                want = ref.forward(layer, x, ids, w)
                client.synchronize()
                calls += 1
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (m, layer)
        armed_now = _armed_calls(port) - before
        assert armed_now >= calls - 2, (armed_now, calls)
        # past the armed buckets: the usual path, the same bits
        for m in (armed.MAX_ROWS + 1, 300):
            x, ids, w = _inputs(m, seed=m)
            got = client.forward(1, x, ids, w)
            want = ref.forward(1, x, ids, w)
            client.synchronize()
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), m
        assert _armed_calls(port) - before == armed_now


def test_back_to_back_calls_alternate_armed_and_usual_and_stay_intact(shard):
    """Calls queued faster than the shard re-arms: some run armed, some the usual way,
    each one's answer is its own."""
    proc, _ = shard
    with (
        ExpertClient([proc.address], on_stream=True) as client,
        ExpertClient([proc.address], transport="grpc") as ref,
    ):
        _arm(client)
        calls = [(_inputs(1 + (i % 4) * 9, seed=200 + i), i % 2) for i in range(30)]
        outs = [client.forward(layer, *inp) for inp, layer in calls]
        client.synchronize()
        for (inp, layer), got in zip(calls, outs, strict=True):
            want = ref.forward(layer, *inp)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_an_idle_lease_disarms_and_arms_again(shard):
    proc, port = shard
    with ExpertClient([proc.address], on_stream=True) as client:
        _arm(client)
        x, ids, w = _inputs(4, seed=3)
        want = client.forward(0, x, ids, w)
        client.synchronize()
        time.sleep(10 * armed.IDLE_S)  # its armed waits are cancelled meanwhile
        before = _armed_calls(port)
        for _ in range(2 * armed.DEPTH + 4):
            got = client.forward(0, x, ids, w)
            client.synchronize()
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert _armed_calls(port) - before >= 2
