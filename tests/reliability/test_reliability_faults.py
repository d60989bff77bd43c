"""Broken links under load, through tests/faultproxy.py: connections reset,
slowed, stalled (a shard slower than any deadline). With replicas every result
must still be right; without, every failing call ends within its deadline with
an error naming the shard's address and experts, no result is ever wrong, and
calls succeed again once the link heals. The clients use gRPC for their data too
(GRPC below): on the same-host data plane the tensors would bypass the proxy."""

from __future__ import annotations

import time

import pytest
from conftest import shard_config
from faultproxy import FaultProxy
from loadgen import TOL, make_cases, run_load

from expertd.client import ExpertClient
from expertd.kernels import relative_error
from expertd.server.app import BackgroundServer
from expertd.server.bank import ExpertBank

GRPC = dict(transport="grpc")  # the links under test carry the tensors
SLACK_S = 1.0  # a failed call may overrun its deadline by this much (2-core CI, GIL)


@pytest.fixture(scope="module")
def replicated():
    """Two replicas of each half of the experts (layer 0); one of each behind a proxy.
    -> (client addresses, {"a": proxy of a replica of experts 0-31, "b": of 32-63})."""
    servers, proxies, addresses = [], {}, []
    for half, name in enumerate("ab"):
        config = shard_config(half, num_shards=2, layers=1)
        bank = ExpertBank.load(config, progress=lambda _m: None)
        pair = [BackgroundServer(config, bank=bank) for _ in range(2)]
        proxies[name] = FaultProxy(pair[0].address)
        servers += pair
        addresses += [proxies[name].address, pair[1].address]
    yield addresses, proxies
    for p in proxies.values():
        p.close()
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def cases(full_layers):
    return make_cases(full_layers, 48, seed=21)


def assert_clean(tally) -> None:
    assert tally.errors == {}, tally.samples
    assert tally.wrong == []


def test_replicas_survive_resets_and_slow_links_under_load(replicated, cases):
    addresses, proxy = replicated

    def faults() -> None:
        for fault, hold in (
            (lambda: proxy["a"].reset(), 1.0),  # replica of 0-31 "crashes"
            (lambda: proxy["b"].slow(0.05), 1.5),  # 50 ms per chunk on a replica of 32-63
            (lambda: (proxy["a"].reset(), proxy["b"].reset()), 1.0),  # both at once
        ):
            time.sleep(0.7)
            fault()
            time.sleep(hold)
            proxy["a"].heal()
            proxy["b"].heal()

    tally, seconds = run_load(addresses, cases, 7.0, threads=12, tasks=12, during=faults, **GRPC)
    print(f"\nresets + slow links, replicas: {tally.summary(seconds)}")
    assert_clean(tally)


def bounded_failures(tally, timeout: float, address: str) -> None:
    """Every failure is ours, names `address`, and came within the deadline."""
    assert tally.wrong == []
    assert {k.split(":")[0] for k in tally.errors} <= {"CoverageError", "ShardCallError"}
    assert max(tally.error_seconds.values(), default=0) <= timeout + SLACK_S, tally.error_seconds
    assert all(address in s for s in tally.samples), tally.samples


def after_start(fault, seconds: float = 0.5):
    """A fault for run_load(during=...): the clients have discovered a healthy service."""
    return lambda: (time.sleep(seconds), fault())


@pytest.fixture(scope="module")
def stalled(replicated, cases):
    """Load while one replica's link stalls (after discovery): a peer that stops answering."""
    addresses, proxy = replicated
    try:
        during = after_start(proxy["a"].stall)
        tally, seconds = run_load(
            addresses, cases, 5.0, threads=8, tasks=8, during=during, timeout=1.5, **GRPC
        )
    finally:
        proxy["a"].heal()
    print(f"\nstalled replica: {tally.summary(seconds)}")
    return tally


def test_stalled_replica_never_hangs_a_call(replicated, stalled):
    bounded_failures(stalled, 1.5, replicated[1]["a"].address)


def test_stalled_replica_fails_over_to_its_twin(stalled):
    assert_clean(stalled)


def test_no_replica_clear_errors_within_deadline_then_recovery(cluster, cases):
    victim = cluster[2]  # experts 16-23, no other owner
    with FaultProxy(victim.address) as proxy:
        addresses = [s.address for s in cluster if s is not victim] + [proxy.address]
        for name, fault, timeout in (
            ("stall", proxy.stall, 1.5),  # slower than any deadline
            ("reset", proxy.reset, 1.5),
            ("slow 2 s per chunk", lambda: proxy.slow(2.0), 1.0),
        ):
            during = after_start(fault)
            tally, seconds = run_load(
                addresses, cases, 3.5, threads=6, tasks=6, during=during, timeout=timeout, **GRPC
            )
            proxy.heal()
            print(f"\n{name}, no replica: {tally.summary(seconds)}")
            assert tally.errors, f"{name}: calls routed to experts 16-23 must fail"
            bounded_failures(tally, timeout, proxy.address)
            assert_recovers(addresses, cases)
        during = after_start(lambda: proxy.slow(0.02))  # within the deadline: time, not results
        tally, seconds = run_load(addresses, cases, 2.5, threads=6, tasks=6, during=during, **GRPC)
        print(f"\nslow 20 ms per chunk, no replica: {tally.summary(seconds)}")
        assert_clean(tally)


def assert_recovers(addresses, cases, within: float = 10.0) -> None:
    """Once the link heals, calls succeed again (probes bring the shard back)."""
    with ExpertClient(addresses, timeout=2, **GRPC) as client:
        deadline = time.monotonic() + within
        for case in cases[:8]:
            while True:
                try:
                    out = client.forward(*case.args)
                    break
                except Exception:
                    assert time.monotonic() < deadline, "shard not back after the link healed"
                    time.sleep(0.1)
            assert relative_error(out, case.want) <= TOL
