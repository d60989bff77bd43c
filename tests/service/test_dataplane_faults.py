"""Faults on the same-host data plane, with real processes: a shard that hangs or
dies in the middle of a call, and a client process that vanishes while it holds
slots (the shard must free them: nothing mapped, no descriptor left)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from conftest import hidden, routing, shard_config

from expertd import dataplane as dp
from expertd.client import ExpertClient, ShardCallError
from expertd.kernels import relative_error
from expertd.launcher import start_shard, stop_shards, wait_serving
from expertd.server.app import BackgroundServer

pytestmark = pytest.mark.skipif(not dp.available(), reason="needs Linux memfd, futex, fd passing")

SERVE = ["--synthetic", "small", "--layers", "1", "--seed", "7", "--num-shards", "1"]
SERVE += ["--device", "cpu", "--log-level", "WARNING", "--torch-threads", "1"]


def case(m: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = hidden(m, gen)
    ids, w = routing(m, gen)
    return x, ids, w


def test_a_shard_that_hangs_then_dies_mid_call():
    """Stopped (SIGSTOP) with a call in its slot: the call fails at its deadline; killed
    with a call in its slot: the lease's end fails it at once, with UNAVAILABLE."""
    shard = start_shard([*SERVE, "--shard", "0"])
    try:
        wait_serving([shard], timeout=300)
        with ExpertClient([shard.address], timeout=60, transport="shm", max_attempts=1) as client:
            x, ids, w = case(3, 1)
            client.forward(0, x, ids, w)
            os.kill(shard.process.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(ShardCallError, match="DEADLINE_EXCEEDED"):
                client.forward(0, x, ids, w, timeout=0.5)
            assert time.monotonic() - t0 < 5
            box = {}

            def call():
                try:
                    box["out"] = client.forward(0, x, ids, w, timeout=60)
                except Exception as e:
                    box["error"] = e

            caller = threading.Thread(target=call)
            caller.start()
            time.sleep(0.5)  # the call is in the stopped shard's slot
            t0 = time.monotonic()
            os.kill(shard.process.pid, signal.SIGKILL)
            caller.join(30)
            assert not caller.is_alive()
            assert time.monotonic() - t0 < 10  # the lease's end, not the 60 s deadline
            error = box.get("error")
            assert isinstance(error, ShardCallError), box
            assert "UNAVAILABLE" in str(error)
    finally:
        with_pid = shard.process
        if with_pid.poll() is None:
            os.kill(with_pid.pid, signal.SIGKILL)
        with_pid.wait(30)


def test_replica_killed_mid_call_fails_over_within_the_deadline():
    shards = [start_shard([*SERVE, "--shard", "0"]) for _ in range(2)]
    try:
        wait_serving(shards, timeout=300)
        addresses = [s.address for s in shards]
        work = [case(m, 10 + m) for m in (1, 2, 3, 4, 5, 6)]
        with ExpertClient(addresses, timeout=30, transport="grpc") as rpc:
            want = [rpc.forward(0, *c) for c in work]
        with ExpertClient(addresses, timeout=30) as client:
            assert {s["transport"] for s in client.stats().values()} == {"shm"}
            os.kill(shards[0].process.pid, signal.SIGSTOP)
            box = {}

            def calls():
                try:
                    box["outs"] = [client.forward(0, *c) for c in work]
                except Exception as e:
                    box["error"] = e

            caller = threading.Thread(target=calls)
            caller.start()
            time.sleep(1.0)  # calls alternate replicas: one sits in the stopped one's slot
            t0 = time.monotonic()
            os.kill(shards[0].process.pid, signal.SIGKILL)
            caller.join(60)
            assert not caller.is_alive() and "error" not in box, box
            assert time.monotonic() - t0 < 20
            for got, ref in zip(box["outs"], want, strict=True):
                assert relative_error(got, ref) <= 1e-2
            stats = client.stats()
            assert not stats[addresses[0]]["alive"]
            assert stats[addresses[1]]["calls"] > 0
    finally:
        for s in shards:
            if s.process.poll() is None:
                with_pid = s.process.pid
                os.kill(with_pid, signal.SIGCONT)
        stop_shards([s for s in shards if s.process.poll() is None])


CLIENT = textwrap.dedent(
    """
    import sys, time, torch
    from expertd.client import ExpertClient
    client = ExpertClient([sys.argv[1]], transport="shm")
    x = torch.zeros((2, 512), dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    client.forward(0, x, ids, torch.full((2, 2), 0.5))
    print("READY", flush=True)
    time.sleep(600)
    """
)


def _slot_mappings(lease_id: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(f"expertd-slot-{lease_id}" in line for line in f)


def _descriptors() -> list[str]:
    """This process's descriptors other than TCP (gRPC's connections close lazily)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            with open("/proc/net/unix") as f:
                inode = target[8:-1]
                if not any(line.split()[6] == inode for line in f.readlines()[1:]):
                    continue  # not a unix socket
        out.append(target)
    return out


def test_a_vanished_client_leaves_nothing_behind():
    with BackgroundServer(shard_config(0, num_shards=1)) as server:
        registry = server.servicer.slots
        fds_before = len(_descriptors())
        proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT, server.address],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout.readline().strip() == "READY"
            leases = registry.stats()
            mine = [lid for lid, info in leases.items() if info["pid"] == proc.pid]
            assert len(mine) == 1
            assert _slot_mappings(mine[0]) == leases[mine[0]]["slots"]
            proc.kill()
            proc.wait(30)
            proc.stdout.close()
            deadline = time.monotonic() + 10
            while mine[0] in registry.stats() or _slot_mappings(mine[0]):
                assert time.monotonic() < deadline, "the dead client's slots are still held"
                time.sleep(0.05)
            deadline = time.monotonic() + 10  # the lease's socket too (gRPC's may linger)
            while len(_descriptors()) > fds_before:
                assert time.monotonic() < deadline, f"descriptors left: {_descriptors()}"
                time.sleep(0.05)
            # ...and the server goes on serving.
            with ExpertClient([server.address]) as client:
                x, ids, w = case(2, 3)
                assert client.forward(0, x, ids, w).shape == (2, 512)
        finally:
            if proc.poll() is None:
                proc.kill()
