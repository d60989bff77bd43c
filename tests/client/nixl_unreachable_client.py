"""A client whose NIXL cannot reach a shard that gRPC and TCP reach (run by
tests/client/test_crosshost.py in a process of its own).

UCX learns a process's network interfaces once, when NIXL first starts in it. This
process starts NIXL, then makes a second host (a network namespace over a veth) and a
shard there: the shard answers gRPC and TCP, but this process's UCX has no interface
toward it, and connecting to the shard's NIXL agent waits for the kernel's TCP
timeout, minutes. The client must lease another data plane within its discovery
timeout, keep its event loop free meanwhile, and answer as gRPC does. Prints one
JSON line: the transport chosen, the seconds to the first answer, whether the bits
match gRPC's, and the longest the event loop went without running a tick, after
"RESULT " (UCX writes its own lines to stdout too)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import torch
from conftest import hidden, routing
from netns import Far

from expertd import nixl
from expertd.aioloop import shared_loop
from expertd.client import ExpertClient
from expertd.launcher import start_shard, stop_shards, wait_serving

SERVE = ["--synthetic", "small", "--layers", "1", "--seed", "7", "--device", "cpu"]
SERVE += ["--log-level", "WARNING", "--torch-threads", "1", "--num-shards", "1", "--shard", "0"]
DISCOVER_S = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0


def main() -> None:
    early = nixl.make_agent("early")  # UCX starts now, before the second host exists
    loop = shared_loop("expertd-client")
    gaps, stop = [0.0], threading.Event()

    def ticks() -> None:  # how late the client's loop runs a callback, at most
        while not stop.is_set():
            sent = time.monotonic()
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=600)
            gaps[0] = max(gaps[0], time.monotonic() - sent)
            time.sleep(0.05)

    with Far.create() as far:
        far.wait_link()
        shard = start_shard([*SERVE, "--listen", f"{far.peer_addr}:0"], prefix=far.prefix)
        try:
            wait_serving([shard], timeout=300)
            gen = torch.Generator().manual_seed(5)
            x, (ids, w) = hidden(3, gen), routing(3, gen)
            watcher = threading.Thread(target=ticks, daemon=True)
            watcher.start()
            start = time.monotonic()
            with ExpertClient([shard.address], discover_timeout=DISCOVER_S) as client:
                out = client.forward(0, x, ids, w)
                took = time.monotonic() - start
                transport = client.stats()[shard.address]["transport"]
            stop.set()
            watcher.join(timeout=60)
            with ExpertClient([shard.address], transport="grpc") as rpc:
                same = torch.equal(
                    out.view(torch.int16), rpc.forward(0, x, ids, w).view(torch.int16)
                )
        finally:
            stop_shards([shard])
    del early
    got = {"transport": transport, "seconds": took, "same": same, "loop_gap_s": gaps[0]}
    print("RESULT", json.dumps(got), flush=True)
    # Not the interpreter's teardown: with a connection attempt still inside NIXL (it
    # ends with the kernel's timeout, minutes away) NIXL's destructors sometimes abort
    # the process (std::terminate), after everything above was checked.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
