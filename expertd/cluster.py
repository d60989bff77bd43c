"""`expertd cluster`: start N local shard servers, keep them up, stop them together.

One `expertd serve` child per shard (expertd/launcher.py starts it). `--gpus 0,1,...` pins
shard s to GPU gpus[s % len(gpus)] through CUDA_VISIBLE_DEVICES, so eight GPUs give one
shard each and `--gpus 0` puts every shard on one GPU; without `--gpus` every child gets
`--device` (cpu, or auto). A child that dies is started again on the address it had, so a
client's address list stays valid; restarts back off (1 s doubling to 30 s) so a shard that
cannot start does not spin. SIGTERM or Ctrl-C drains every child (their own --grace) and
exits 0 when all of them exited cleanly.

stdout, for people and scripts: one `shard S ADDRESS pid PID device DEV` line per child
start (restarts too), `ADDRESSES a,b,...` once all are bound, `SERVING` once all serve.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from expertd.launcher import (
    ShardProcess,
    health_status,
    start_shard,
    stop_shards,
)

log = logging.getLogger("expertd.cluster")

SERVING = 1  # grpc.health.v1 HealthCheckResponse.SERVING
BACKOFF_S = (1.0, 30.0)  # first and largest wait before restarting a dead shard
STABLE_S = 60.0  # a shard up this long has its backoff reset


@dataclass
class Slot:
    """One shard's place in the cluster: how to start it, and its current process."""

    index: int
    serve_args: list[str]
    env: dict[str, str]
    device: str
    listen: str
    shard: ShardProcess | None = None
    started: float = 0.0
    restarts: int = 0
    next_try: float = 0.0
    serving: bool = False

    def start(self) -> None:
        self.shard = start_shard([*self.serve_args, "--listen", self.listen], env=self.env)
        self.listen = self.shard.address  # port 0 resolved: restarts keep this address
        self.started = time.monotonic()
        self.serving = False
        print(
            f"shard {self.index} {self.shard.address} pid {self.shard.process.pid} "
            f"device {self.device}",
            flush=True,
        )


def plan(args) -> list[Slot]:
    """The slots for args: every child's serve flags, env and listen address."""
    if bool(args.checkpoint) == bool(args.synthetic):
        raise ValueError("give exactly one of --checkpoint DIR or --synthetic PRESET")
    if args.shards < 1:
        raise ValueError(f"--shards must be >= 1, got {args.shards}")
    source = (
        ["--checkpoint", args.checkpoint] if args.checkpoint else ["--synthetic", args.synthetic]
    )
    if args.layers is not None:
        source += ["--layers", str(args.layers)]
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()] if args.gpus else []
    if args.gpus and not gpus:
        raise ValueError(f"--gpus {args.gpus!r} names no GPU")
    # Shards share the cores; torch's default (all cores each) would oversubscribe them.
    threads = args.torch_threads or max(1, (os.cpu_count() or 1) // args.shards)
    slots = []
    for s in range(args.shards):
        env = {}
        device = args.device
        if gpus:  # the child sees only its GPU, as cuda:0
            env["CUDA_VISIBLE_DEVICES"] = gpus[s % len(gpus)]
            device = "cuda"
        serve_args = [
            *source,
            *("--seed", str(args.seed), "--shard", str(s), "--num-shards", str(args.shards)),
            *("--device", device, "--grace", str(args.grace), "--torch-threads", str(threads)),
            *("--log-level", args.log_level),
        ]
        port = args.base_port + s if args.base_port else 0
        shown = f"cuda (GPU {env['CUDA_VISIBLE_DEVICES']})" if gpus else device
        slots.append(Slot(s, serve_args, env, shown, f"{args.host}:{port}"))
    return slots


class Supervisor:
    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots
        self.stopping = threading.Event()

    def start_all(self, timeout: float) -> None:
        with ThreadPoolExecutor(len(self.slots)) as pool:  # each child imports torch: overlap
            list(pool.map(Slot.start, self.slots))
        print("ADDRESSES " + ",".join(s.listen for s in self.slots), flush=True)
        deadline = time.monotonic() + timeout
        while not self.stopping.is_set():  # a Ctrl-C while loading stops at once
            pending = [s for s in self.slots if not s.serving]
            if not pending:
                print("SERVING", flush=True)
                return
            if time.monotonic() > deadline:
                names = ", ".join(s.listen for s in pending)
                raise TimeoutError(f"shards not SERVING after {timeout:.0f} s: {names}")
            for slot in pending:
                if not slot.shard.alive():  # a shard that cannot load fails the start
                    tail = "\n".join(slot.shard.log[-20:])
                    code = slot.shard.process.returncode
                    raise RuntimeError(f"shard {slot.index} exited with {code} loading:\n{tail}")
                slot.serving = health_status(slot.listen) == SERVING
            self.stopping.wait(0.2)

    def watch_once(self) -> None:
        """Restart dead shards (after their backoff); note restarted ones that serve again."""
        now = time.monotonic()
        for slot in self.slots:
            if self.stopping.is_set():
                return
            if slot.shard is not None and slot.shard.alive():
                if not slot.serving and health_status(slot.listen) == SERVING:
                    slot.serving = True
                    log.info("shard %d SERVING again on %s", slot.index, slot.listen)
                continue
            if slot.shard is not None:  # just found dead: schedule the restart
                code = slot.shard.process.returncode
                tail = "\n".join(slot.shard.log[-5:])
                up = now - slot.started
                wait = BACKOFF_S[0] if up > STABLE_S else _backoff(slot.restarts)
                log.warning(
                    "shard %d (%s) exited with %s after %.0f s; restarting in %.0f s\n%s",
                    *(slot.index, slot.listen, code, up, wait, tail),
                )
                slot.restarts = 0 if up > STABLE_S else slot.restarts + 1
                slot.shard, slot.next_try = None, now + wait
            if now >= slot.next_try:
                try:
                    slot.start()
                except (RuntimeError, OSError) as e:
                    slot.restarts += 1
                    slot.next_try = time.monotonic() + _backoff(slot.restarts)
                    log.error("shard %d did not start on %s: %s", slot.index, slot.listen, e)

    def stop(self, grace: float) -> int:
        self.stopping.set()
        live = [s for s in self.slots if s.shard is not None]
        codes = stop_shards([s.shard for s in live], timeout=grace + 15)
        # Ctrl-C in a terminal signals the children too (same process group), so a child
        # may finish its drain and die of our second signal: that is a clean stop as well.
        clean = (0, -signal.SIGTERM, -signal.SIGINT)
        bad = [(s.index, c) for s, c in zip(live, codes, strict=True) if c not in clean]
        for index, code in bad:
            log.error("shard %d exited with %s on stop", index, code)
        return 1 if bad else 0


def _backoff(restarts: int) -> float:
    return min(BACKOFF_S[0] * 2**restarts, BACKOFF_S[1])


def run_cluster(args) -> int:
    slots = plan(args)
    supervisor = Supervisor(slots)

    def on_signal(signum, _frame) -> None:
        # Only flag it: the main loop stops the children, so no restart races the stop.
        log.info("%s: stopping %d shards", signal.Signals(signum).name, len(slots))
        supervisor.stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        supervisor.start_all(args.startup_timeout)
        while not supervisor.stopping.wait(0.5):
            supervisor.watch_once()
    except (RuntimeError, TimeoutError) as e:
        print(f"expertd cluster: {e}", file=sys.stderr)
        supervisor.stop(args.grace)
        return 1
    return supervisor.stop(args.grace)
