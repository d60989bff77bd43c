"""Load and process faults against real shard processes (`expertd serve`, as
deployed): 64 concurrent callers with every result checked and server memory
flat; kill -9 and restart under load, with replicas (nothing lost) and without
(clear errors within the deadline, recovery when the shard is back).

The figures printed here (pytest -s) are for a 2-core CPU VM running the
`small` preset; the test asserts correctness and zero errors, never speed.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import SEED
from loadgen import make_cases, rss_mib, run_load

from expertd.client import ExpertClient
from expertd.kernels import relative_error
from expertd.launcher import start_shard, stop_shards, wait_serving

SHARDS = 8
REPLICATED = (0, 1)  # these shards get a second process: kill -9 one and nothing may be lost
LOAD_S = 10.0
SLACK_S = 1.0  # a failed call may overrun its deadline by this much (2-core CI, GIL)


def serve_args(shard: int) -> list[str]:
    return [
        *("--synthetic", "small", "--layers", "1", "--seed", str(SEED)),
        *("--shard", str(shard), "--num-shards", str(SHARDS), "--torch-threads", "1"),
    ]


@pytest.fixture(scope="module")
def procs():
    """name -> ShardProcess: 's0'..'s7', plus replicas 'r0', 'r1' of shards 0 and 1."""
    names = [f"s{s}" for s in range(SHARDS)] + [f"r{s}" for s in REPLICATED]
    started = {n: start_shard(serve_args(int(n[1:]))) for n in names}
    wait_serving(list(started.values()), timeout=180)
    yield started
    stop_shards(list(started.values()), timeout=10)


@pytest.fixture(scope="module")
def cases(full_layers):
    return make_cases(full_layers, 96, seed=11)


def restart(procs, name: str) -> None:
    """Start `name` again on the address it had (as `expertd cluster` does)."""
    old = procs[name]
    procs[name] = start_shard([*serve_args(int(name[1:])), "--listen", old.address])
    wait_serving([procs[name]], timeout=60)


def kill9(procs, name: str) -> None:
    os.kill(procs[name].process.pid, signal.SIGKILL)
    procs[name].process.wait()


def report(title: str, summary: dict) -> None:
    print(f"\n{title}: " + ", ".join(f"{k}={v}" for k, v in summary.items()))


def test_64_clients_all_correct_memory_flat(procs, cases):
    addresses = [p.address for p in procs.values()]
    pids = {n: p.process.pid for n, p in procs.items()}
    before = {n: rss_mib(pid) for n, pid in pids.items()}
    warm, seconds = run_load(addresses, cases, 3.0, threads=8, tasks=8, timeout=30)
    assert warm.errors == {} and warm.wrong == []
    warmed = {n: rss_mib(pid) for n, pid in pids.items()}
    tally, seconds = run_load(addresses, cases, LOAD_S, threads=32, tasks=32, timeout=30)
    end = {n: rss_mib(pid) for n, pid in pids.items()}
    summary = tally.summary(seconds)
    report("load, 64 callers, 10 processes", summary)
    print(
        "RSS MiB before/warm/end: "
        + ", ".join(f"{n} {before[n]:.0f}/{warmed[n]:.0f}/{end[n]:.0f}" for n in pids)
    )
    assert tally.errors == {}, tally.samples
    assert tally.wrong == []
    assert summary["calls"] >= 64  # every caller got through at least once on average
    for n in pids:  # flat: allocator noise and batch-size high-water marks, not growth
        assert end[n] <= warmed[n] * 1.10 + 24, f"{n}: {warmed[n]:.0f} -> {end[n]:.0f} MiB"


def test_kill9_and_restart_replicas_under_load(procs, cases):
    addresses = [p.address for p in procs.values()]

    def faults() -> None:  # one replica of shard 0 then one of shard 1, each back on its address
        for name in ("s0", "r1"):
            time.sleep(1.0)
            kill9(procs, name)
            time.sleep(0.5)
            restart(procs, name)

    tally, seconds = run_load(
        addresses, cases, 10.0, threads=16, tasks=16, during=faults, timeout=10
    )
    report("kill -9 + restart of replicas under load", tally.summary(seconds))
    assert tally.errors == {}, tally.samples
    assert tally.wrong == []
    assert all(p.alive() for p in procs.values())


def test_kill9_without_replica_clear_errors_then_recovery(procs, cases):
    addresses = [p.address for p in procs.values()]
    victim, timeout = "s5", 2.0  # experts 40-47 live only there

    def faults() -> None:
        time.sleep(1.0)
        kill9(procs, victim)
        time.sleep(3.0)  # a few deadlines' worth of calls against a dead shard
        restart(procs, victim)

    tally, seconds = run_load(
        addresses, cases, 8.0, threads=8, tasks=8, during=faults, timeout=timeout
    )
    report("kill -9 + restart, no replica", tally.summary(seconds))
    assert tally.wrong == []
    assert tally.errors, "calls routed to the dead shard must fail"
    assert {k.split(":")[0] for k in tally.errors} <= {"CoverageError", "ShardCallError"}, (
        tally.errors
    )
    assert max(tally.error_seconds.values()) <= timeout + SLACK_S, tally.error_seconds
    dead = procs[victim].address
    assert all(dead in s for s in tally.samples), tally.samples
    with ExpertClient(addresses, timeout=10) as client:  # back: every call correct again
        for case in cases[:10]:
            assert relative_error(client.forward(*case.args), case.want) <= 1e-2
