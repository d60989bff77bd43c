"""Two hosts on one machine: this process is the client, and shard processes run in
another network namespace reached over a veth pair (benchmarks/netns.py). Every byte
to them takes a real network hop, and their abstract unix sockets, which prove "same
host" to the client, are out of reach, as from another host.

What it protects: `transport="auto"` does not take a shard over there for a local one
(it gets NIXL, or raw TCP slots without NIXL) and keeps shared memory for the shard
beside it in one client; the forced tcp and nixl planes work across the hop; all of
them answer with the gRPC path's bits; a cut link fails a call with a clear error at
its deadline, never a hang, and calls succeed again once the link is back. Skipped
where network namespaces cannot be made (not root, no iproute2, no CAP_SYS_ADMIN)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from conftest import hidden, routing

from expertd import nixl
from expertd.client import CoverageError, ExpertClient, ShardCallError
from expertd.launcher import start_shard, stop_shards, wait_serving

SERVE = ["--synthetic", "small", "--layers", "1", "--seed", "7", "--device", "cpu"]
SERVE += ["--log-level", "WARNING", "--torch-threads", "1"]
REMOTE = "nixl" if nixl.available() else "tcp"  # what "auto" picks for another host
PLANES = [
    "tcp",
    pytest.param(
        "nixl",
        marks=pytest.mark.skipif(not nixl.available(), reason=f"NIXL not importable: {nixl.why()}"),
    ),
]
DEADLINE = 1.0  # s, of the calls made while the link is down
MARGIN = 1.5  # s past the deadline a failed call may take on a loaded 2-core machine
HEAL_S = 30.0  # s for a call to succeed again once the link is back


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def case(m: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x, (ids, w) = hidden(m, gen), routing(m, gen)
    if m > 2:  # some rows with a padded route
        ids[::2, -1] = -1
        w[::2, -1] = 0.0
    return x, ids, w


@pytest.fixture(scope="module")
def far(request):
    """The namespace tests/conftest.py made before any test ran (see there why)."""
    pair = getattr(request.config, "expertd_far", None)
    if pair is None:
        why = getattr(request.config, "expertd_far_why", "not made")
        pytest.skip(f"no second network namespace on this machine: {why}")
    return pair


@pytest.fixture(scope="module")
def shards(far):
    """Shards 0 and 1 of 2 over the veth (remote), and shard 0 of 2 again in this
    namespace on loopback (local): the same weights, so either shard 0 serves."""
    procs = []
    try:
        for s in (0, 1):
            listen = ["--listen", f"{far.peer_addr}:0"]
            args = [*SERVE, "--num-shards", "2", "--shard", str(s), *listen]
            procs.append(start_shard(args, prefix=far.prefix))
        procs.append(start_shard([*SERVE, "--num-shards", "2", "--shard", "0"]))
        wait_serving(procs, timeout=300)  # health over the veth for the remote ones
        remote, local = [p.address for p in procs[:2]], procs[2].address
        assert all(a.startswith(f"{far.peer_addr}:") for a in remote), remote
        yield SimpleNamespace(remote=remote, local=local)
    finally:
        stop_shards(procs)


def transports(client: ExpertClient) -> dict[str, str]:
    return {a: s["transport"] for a, s in client.stats().items()}


def same_bits(client: ExpertClient, rpc: ExpertClient, ms=(0, 1, 7, 300)) -> None:
    """Both clients' answers at each M, bit for bit, on the caller's thread's path
    and on the event loop's."""
    for m in ms:
        x, ids, w = case(m, 100 + m)
        a, b = client.forward(0, x, ids, w), rpc.forward(0, x, ids, w)
        assert a.shape == (m, 512) and a.dtype == torch.bfloat16
        assert torch.equal(bits(a), bits(b)), m
        assert torch.equal(bits(client.submit(0, x, ids, w).result()), bits(b)), m


def test_auto_uses_no_same_host_plane_with_shards_on_another_host(shards):
    with (
        ExpertClient(shards.remote, transport="auto") as auto,
        ExpertClient(shards.remote, transport="grpc") as rpc,
    ):
        assert transports(auto) == dict.fromkeys(shards.remote, REMOTE)
        assert transports(rpc) == dict.fromkeys(shards.remote, "grpc")
        same_bits(auto, rpc)
        assert transports(auto) == dict.fromkeys(shards.remote, REMOTE)
        assert all(s["calls"] > 0 for s in auto.stats().values())


def test_one_client_keeps_shm_for_the_local_shard_beside_a_remote_one(shards):
    addresses = [shards.local, shards.remote[1]]
    with (
        ExpertClient(addresses, transport="auto") as auto,
        ExpertClient(addresses, transport="grpc") as rpc,
    ):
        want = {shards.local: "shm", shards.remote[1]: REMOTE}
        assert transports(auto) == want
        same_bits(auto, rpc)
        assert transports(auto) == want
        assert all(s["calls"] > 0 for s in auto.stats().values())


@pytest.mark.parametrize("transport", PLANES)
def test_a_forced_plane_across_the_veth_matches_grpc(shards, transport):
    with (
        ExpertClient(shards.remote, transport=transport) as forced,
        ExpertClient(shards.remote, transport="grpc") as rpc,
    ):
        assert transports(forced) == dict.fromkeys(shards.remote, transport)
        same_bits(forced, rpc)
        assert transports(forced) == dict.fromkeys(shards.remote, transport)


def bounded(call, limit: float):
    """call() on a thread -> its result or the exception it raised; fails the test if
    it has not returned after `limit` s (a hang, not an error)."""
    box = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as e:
            box["value"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        pytest.fail(f"the call hung: no answer and no error after {limit:.0f} s")
    return box["value"]


@pytest.mark.parametrize("transport", PLANES)
def test_a_cut_link_fails_calls_at_their_deadline_and_calls_succeed_once_it_is_back(
    far, shards, transport
):
    """The far end's link down (packets dropped, no reset): a call through a slot, on
    the caller's thread and on the event loop, ends with the shard's DEADLINE_EXCEEDED
    or UNAVAILABLE within its deadline and a margin; once the link is up, a call
    succeeds again within HEAL_S, on the same plane, with the same bits."""
    x, ids, w = case(7, 42)
    with ExpertClient(shards.remote, transport=transport, max_attempts=1) as client:
        good = client.forward(0, x, ids, w)
        assert transports(client) == dict.fromkeys(shards.remote, transport)
        calls = {
            "forward": lambda: client.forward(0, x, ids, w, timeout=DEADLINE),
            "submit": lambda: client.submit(0, x, ids, w, timeout=DEADLINE).result(),
        }
        far.link_down()
        try:
            for path, call in calls.items():
                t0 = time.monotonic()
                err = bounded(call, DEADLINE + MARGIN + 10)
                elapsed = time.monotonic() - t0
                assert isinstance(err, ShardCallError), (path, err)
                codes = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
                assert err.code in codes, (path, err)
                assert err.address in shards.remote, (path, err)
                assert elapsed < DEADLINE + MARGIN, (path, elapsed, err)
        finally:
            far.link_up()

        t0, tries, last = time.monotonic(), 0, None
        while True:
            tries += 1
            out = bounded(lambda: client.forward(0, x, ids, w, timeout=2.0), 15)
            if isinstance(out, torch.Tensor):
                break
            assert isinstance(out, (ShardCallError, CoverageError)), out
            last = out
            if time.monotonic() - t0 > HEAL_S:
                pytest.fail(f"no call succeeded in {HEAL_S:.0f} s ({tries} tries): {last}")
            time.sleep(0.25)
        assert torch.equal(bits(out), bits(good))
        assert torch.equal(bits(client.submit(0, x, ids, w).result()), bits(good))
        assert transports(client) == dict.fromkeys(shards.remote, transport)


@pytest.mark.skipif(not nixl.available(), reason=f"NIXL not importable: {nixl.why()}")
def test_a_shard_nixl_cannot_reach_costs_the_lease_timeout_not_the_client(far):
    """In a process whose UCX cannot reach the shard's host (nixl_unreachable_client.py
    says how), connecting to the shard's agent waits minutes: the client gives up on
    NIXL within its discovery timeout, off its event loop (which keeps running), leases
    tcp slots instead and answers as gRPC does."""
    discover = 3.0
    script = Path(__file__).with_name("nixl_unreachable_client.py")
    done = subprocess.run(
        [sys.executable, str(script), str(discover)], capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, done.stdout[-3000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    assert got["transport"] == "tcp" and got["same"], got
    assert got["seconds"] < discover + 10, got  # not the kernel's connect timeout
    assert got["loop_gap_s"] < 1.0, got  # the loop was never held by the connection
