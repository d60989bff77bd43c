"""Start shard servers as local subprocesses and wait until they serve.

Used by `expertd cluster` and `expertd demo` (and by tests and benchmarks that
need real processes): each child is `python -m expertd serve ...`, on a free loopback
port unless told otherwise; it prints one line `LISTENING <address>` once bound, and reports
SERVING on grpc.health.v1 once its experts are loaded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass
class ShardProcess:
    args: list[str]
    process: subprocess.Popen
    address: str = ""
    log: list[str] = field(default_factory=list)  # the child's stderr, kept for errors

    def alive(self) -> bool:
        return self.process.poll() is None


def _pump(stream, sink: list[str]) -> None:
    for line in stream:
        sink.append(line.rstrip("\n"))
        del sink[:-200]  # keep the tail only


def start_shard(
    serve_args: list[str], env: dict[str, str] | None = None, prefix: list[str] | None = None
) -> ShardProcess:
    """Start `expertd serve <serve_args>` and return once it printed its address.

    Without --listen (in the args or EXPERTD_LISTEN) the child takes a free loopback port,
    not serve's fixed default, so shards started side by side never collide. `prefix`
    goes before the command (e.g. `ip netns exec NAME`: a program that runs the rest)."""
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    named = env.get("EXPERTD_LISTEN") or any(a.split("=")[0] == "--listen" for a in serve_args)
    free_port = [] if named else ["--listen", "127.0.0.1:0"]
    cmd = [*(prefix or []), sys.executable, "-m", "expertd", "serve", *serve_args, *free_port]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    shard = ShardProcess(serve_args, proc)
    threading.Thread(target=_pump, args=(proc.stderr, shard.log), daemon=True).start()
    for line in proc.stdout:
        if line.startswith("LISTENING "):
            shard.address = line.split(None, 1)[1].strip()
            break
    if not shard.address:
        proc.wait(timeout=30)
        tail = "\n".join(shard.log[-20:])
        raise RuntimeError(f"shard server exited with {proc.returncode} before binding:\n{tail}")
    threading.Thread(target=lambda: proc.stdout.read(), daemon=True).start()
    return shard


def wait_serving(shards: list[ShardProcess], timeout: float) -> None:
    """Poll grpc.health.v1 until every shard says SERVING (or one dies, or time runs out)."""
    deadline = time.monotonic() + timeout
    pending = list(shards)
    while pending:
        for shard in list(pending):
            if not shard.alive():
                tail = "\n".join(shard.log[-20:])
                raise RuntimeError(
                    f"shard {shard.address} exited with {shard.process.returncode}:\n{tail}"
                )
            if health_status(shard.address) == health_pb2.HealthCheckResponse.SERVING:
                pending.remove(shard)
        if pending and time.monotonic() > deadline:
            names = ", ".join(s.address for s in pending)
            raise TimeoutError(f"shards not SERVING after {timeout:.0f} s: {names}")
        if pending:
            time.sleep(0.2)


def health_status(address: str, timeout: float = 1.0) -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.RpcError:
            return None
    return reply.status


def stop_shards(shards: list[ShardProcess], timeout: float = 30.0) -> list[int]:
    """SIGTERM every shard, wait for all; SIGKILL stragglers. Returns exit codes."""
    for shard in shards:
        if shard.alive():
            shard.process.send_signal(signal.SIGTERM)
    codes = []
    deadline = time.monotonic() + timeout
    for shard in shards:
        try:
            codes.append(shard.process.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            shard.process.kill()
            codes.append(shard.process.wait())
    return codes
