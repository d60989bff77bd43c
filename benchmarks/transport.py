"""Transport benchmark (../shared/PERF.md, "The service"; docs/dataplane.md): the real
client against real shard processes, per transport, next to what the shards computed.

    python benchmarks/transport.py [--device cuda] [--preset small] [--ms 1,16,256,4096]
                                   [--reps 200] [--out DIR]

For each M, each transport (grpc: the ForwardStream path; shm: shared-memory slots;
nixl: slots registered over NIXL, forced between processes of this host, UCX picking
the transport (UCX_TLS=tcp,self in the environment measures TCP); cuda-ipc where
the client's tensors are on a GPU and the shard offers it; cuda-ipc-stream: the same
slots with the calls queued on the caller's stream, client/onstream.py) and 1 shard
(one process holding every expert) or 8 shards (8 processes): the client's end-to-end
`ExpertClient.forward` time to the caller's stream having the answer (p50, p99), and
per call when calls are issued back to back and waited for once ("queued"), and p50
when each call follows --gap-us of the caller's own work ("spaced": a frontend's
attention between two layers, host and GPU busy, long enough for waiters to go
to sleep), next to
the busiest shard's forward (the
server's Timing.compute_us of that call: staging, copies, kernels) and the sum of the
shards' forwards; overhead = e2e - busiest forward, per call. In the same run, the
floors: a raw TCP echo round trip of the call's bytes (request out, partial back)
between two processes, a grpc.aio stream echo of the same bytes, a futex doorbell
round trip through shared memory between two processes, with NIXL installed a NIXL
echo (the call's bytes WRITten with a notification, the partial's bytes WRITten back
with one, between two processes' agents) and (CUDA) a device-to-device copy of the
same bytes. Prints a table last, then where each row's calls went: the client's
stages (client/telemetry.py: staging, routing, the shard's queue and forward, the
transfer and, for same-host slots, its two wake-ups, the sum), mean us per call;
writes JSON + PNG only with --out.

--netns starts the shards in another network namespace, reached over a veth pair
(benchmarks/netns.py: a second host on this machine, root only): the client stays
here, so every call crosses a real network hop and no shard is on "this host"
(shm and cuda-ipc are left out of the default transports). The TCP, gRPC and NIXL
echo floors then cross the same veth (their far end runs in that namespace); the
doorbell floor stays on this host, where shared memory is.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime as dt
import json
import mmap
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch
from netns import Far, NetnsUnavailable, enter

from expertd import dataplane as dp
from expertd import nixl
from expertd.client import ExpertClient, shm
from expertd.launcher import start_shard, stop_shards, wait_serving
from expertd.server.synthetic import get_preset

OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


# -- floors ------------------------------------------------------------------------------


def _where(far: Far | None) -> str:
    """The echo servers' address: loopback, or the far end of the veth (--netns)."""
    return "127.0.0.1" if far is None else far.peer_addr


def _tcp_echo_server(port_q, reply_size: int, far: Far | None) -> None:
    if far is not None:
        enter(far.name)
    srv = socket.socket()
    srv.bind((_where(far), 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reply = bytes(reply_size)
    buf = bytearray(1 << 20)
    while True:
        head = conn.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return
        need = int.from_bytes(head, "little")
        while need:
            n = conn.recv_into(buf, min(need, len(buf)))
            if not n:
                return
            need -= n
        conn.sendall(reply)


def tcp_echo_us(request: int, reply: int, reps: int, far: Far | None = None) -> list[float]:
    """Round trips of `request` bytes out, `reply` bytes back, over loopback TCP (over
    the veth to `far`'s namespace with --netns)."""
    q = mp.get_context("fork").Queue()
    proc = mp.get_context("fork").Process(
        target=_tcp_echo_server, args=(q, reply, far), daemon=True
    )
    proc.start()
    port = q.get(timeout=30)
    sock = socket.create_connection((_where(far), port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = request.to_bytes(8, "little") + bytes(request)
    back = bytearray(max(reply, 1))
    times = []
    for i in range(reps + 20):
        t0 = time.perf_counter()
        sock.sendall(payload)
        got = 0
        while got < reply:
            got += sock.recv_into(memoryview(back)[got:], reply - got)
        if i >= 20:
            times.append((time.perf_counter() - t0) * 1e6)
    sock.close()
    proc.join(5)
    return times


def _hold(seconds: float) -> None:
    """Keep this thread (an echo server's event loop) busy for `seconds`, as a shard's
    forward does: asleep, the interpreter's lock let go, then on time to the microsecond."""
    end = time.perf_counter() + seconds
    if seconds > HOLD_SPIN_S:
        time.sleep(seconds - HOLD_SPIN_S)
    while time.perf_counter() < end:
        pass


HOLD_SPIN_S = 200e-6  # _hold's last stretch: a sleep overshoots by tens of microseconds


def _grpc_echo_server(port_q, reply_size: int, far: Far | None, hold_s: float = 0.0) -> None:
    if far is not None:
        enter(far.name)

    async def main() -> None:
        reply = bytes(reply_size)

        async def echo(requests, context):
            async for _ in requests:
                if hold_s:
                    _hold(hold_s)
                yield reply

        server = grpc.aio.server(options=OPTIONS)
        handler = grpc.stream_stream_rpc_method_handler(
            echo, request_deserializer=bytes, response_serializer=bytes
        )
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("floor.Echo", {"Stream": handler})]
        )
        port_q.put(server.add_insecure_port(f"{_where(far)}:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def grpc_echo_us(
    request: int, reply: int, reps: int, far: Far | None = None, hold_us: float = 0.0
) -> list[float]:
    """Round trips on one grpc.aio bidirectional stream (client and server grpc.aio).
    hold_us: the server's loop busy that long before each answer (a shard's forward
    on it), taken off each round trip: what the stream costs a call of that length,
    whose waiting threads fall asleep meanwhile. The server is a fresh process (spawned:
    a child forked after this process used gRPC may hang in it)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_grpc_echo_server, args=(q, reply, far, hold_us / 1e6), daemon=True)
    proc.start()
    port = q.get(timeout=30)

    async def run() -> list[float]:
        async with grpc.aio.insecure_channel(f"{_where(far)}:{port}", options=OPTIONS) as ch:
            call = ch.stream_stream(
                "/floor.Echo/Stream", request_serializer=bytes, response_deserializer=bytes
            )()
            payload = bytes(request)
            times = []
            for i in range(reps + 20):
                t0 = time.perf_counter()
                await call.write(payload)
                await call.read()
                if i >= 20:
                    times.append((time.perf_counter() - t0) * 1e6 - hold_us)
            await call.done_writing()
            return times

    try:
        return asyncio.run(run())
    finally:
        proc.kill()
        proc.join(5)


def _doorbell_peer(fd: int) -> None:
    mm = mmap.mmap(fd, dp.CONTROL_BYTES)
    ctl = dp.Control.from_buffer(mm)
    base = ctypes.addressof(ctl)
    req, resp = base + dp.Control.req_seq.offset, base + dp.Control.resp_seq.offset
    last = 0
    while True:
        # the shard's side: no spin, FUTEX_WAIT (server/slots.py WAIT_SPIN_S)
        dp.wait_word(ctl, "req_seq", req, last, time.monotonic() + 1.0, 0.0)
        last = ctl.req_seq
        if last == 0xFFFFFFFF:
            return
        ctl.resp_seq = last
        dp.futex_wake(resp)


def doorbell_us(reps: int, spin_s: float) -> list[float]:
    """Ring a peer process through a shared control block and wait for its answer."""
    fd = dp.sealed_memfd("doorbell", dp.CONTROL_BYTES)
    proc = mp.get_context("fork").Process(target=_doorbell_peer, args=(fd,), daemon=True)
    proc.start()
    mm = mmap.mmap(fd, dp.CONTROL_BYTES)
    ctl = dp.Control.from_buffer(mm)
    base = ctypes.addressof(ctl)
    req, resp = base + dp.Control.req_seq.offset, base + dp.Control.resp_seq.offset
    times = []
    for i in range(1, reps + 21):
        t0 = time.perf_counter()
        ctl.req_seq = i
        dp.futex_wake(req)
        while ctl.resp_seq != i:
            dp.wait_word(ctl, "resp_seq", resp, i - 1, time.monotonic() + 1.0, spin_s)
        if i > 20:
            times.append((time.perf_counter() - t0) * 1e6)
    ctl.req_seq = 0xFFFFFFFF
    dp.futex_wake(req)
    proc.join(5)
    del ctl
    mm.close()
    os.close(fd)
    return times


def _echo_buffer(nbytes: int, on_gpu: bool):
    """-> (buffer, its address, device id, NIXL memory kind): host or GPU memory."""
    if on_gpu:
        buf = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        return buf, buf.data_ptr(), buf.device.index or 0, nixl.DEVICE
    import numpy as np

    buf = np.ones(nbytes, np.uint8)
    return buf, buf.ctypes.data, 0, nixl.HOST


def _nixl_peer(md_q, back_q, nbytes: int, reply: int, netns: str | None, on_gpu: bool) -> None:
    """The echo's far end: on each notification, WRITE `reply` bytes back with one."""
    if netns is not None:
        enter(netns)
    agent = nixl.make_agent("echo")
    _buf, addr, dev, kind = _echo_buffer(max(nbytes, reply, 1), on_gpu)
    agent.register_memory([(addr, max(nbytes, reply, 1), dev, "")], kind)
    md_q.put((agent.get_agent_metadata(), addr, dev))
    peer_md, peer_addr, peer_dev = back_q.get()
    peer = agent.add_remote_agent(peer_md)
    while True:
        for _name, msgs in agent.get_new_notifs().items():
            for msg in msgs:
                if msg == b"stop":
                    return
                if reply:
                    local = agent.get_xfer_descs([(addr, reply, dev)], kind)
                    remote = agent.get_xfer_descs([(peer_addr, reply, peer_dev)], kind)
                    h = agent.initialize_xfer("WRITE", local, remote, peer, b"r")
                    agent.transfer(h)
                    while agent.check_xfer_state(h) == "PROC":
                        pass
                    agent.release_xfer_handle(h)
                else:
                    agent.send_notif(peer, b"r")


def nixl_echo_us(
    request: int, reply: int, reps: int, far: Far | None = None, on_gpu: bool = False
) -> list[float]:
    """NIXL WRITE of `request` bytes with a notification, answered by a WRITE of
    `reply` bytes with one (two processes, busy polling on both ends; host memory, or
    GPU memory at both ends with `on_gpu`)."""
    ctx = mp.get_context("spawn")
    md_q, back_q = ctx.Queue(), ctx.Queue()
    netns = None if far is None else far.name
    proc = ctx.Process(
        target=_nixl_peer, args=(md_q, back_q, request, reply, netns, on_gpu), daemon=True
    )
    proc.start()
    agent = nixl.make_agent("bench")
    _buf, addr, dev, kind = _echo_buffer(max(request, reply, 1), on_gpu)
    agent.register_memory([(addr, max(request, reply, 1), dev, "")], kind)
    peer_md, peer_addr, peer_dev = md_q.get(timeout=120)
    back_q.put((agent.get_agent_metadata(), addr, dev))
    peer = agent.add_remote_agent(peer_md)
    times = []
    try:
        for i in range(reps + 10):
            t0 = time.perf_counter()
            if request:
                local = agent.get_xfer_descs([(addr, request, dev)], kind)
                remote = agent.get_xfer_descs([(peer_addr, request, peer_dev)], kind)
                h = agent.initialize_xfer("WRITE", local, remote, peer, b"c")
                agent.transfer(h)
            else:
                h = None
                agent.send_notif(peer, b"c")
            got = False
            deadline = time.monotonic() + 30
            while not got:
                if h is not None and agent.check_xfer_state(h) != "PROC":
                    agent.release_xfer_handle(h)
                    h = None
                got = bool(agent.get_new_notifs())
                if time.monotonic() > deadline:
                    raise TimeoutError("NIXL echo: no answer in 30 s")
            if h is not None:
                while agent.check_xfer_state(h) == "PROC":
                    pass
                agent.release_xfer_handle(h)
            if i >= 10:
                times.append((time.perf_counter() - t0) * 1e6)
        agent.send_notif(peer, b"stop")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return times


def d2d_us(nbytes: int, reps: int) -> list[float]:
    if not torch.cuda.is_available():
        return []
    a = torch.empty(max(nbytes, 1), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for i in range(reps + 10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        if i >= 10:
            times.append(s.elapsed_time(e) * 1e3)
    return times


# -- the service -------------------------------------------------------------------------


def routing(m: int, preset, gen):
    logits = torch.randn((m, preset.num_experts), generator=gen)
    top = logits.topk(preset.top_k, dim=1)
    return top.indices.to(torch.int32), torch.softmax(top.values, dim=1)


def spaced_us(call, gap_us: float, n: int, gpu: bool = False) -> list[float]:
    """e2e of `n` calls, each after `gap_us` in which no call is out: the caller's host
    busy with its own work, as a frontend's between two MoE layers, and with `gpu` its
    GPU too (a kernel that spins for about as long, waited for before the call: its
    attention, done), so the GPU keeps the clocks of a busy one."""
    times = []
    for i in range(n if gap_us > 0 else 0):
        end = time.perf_counter() + gap_us / 1e6
        if gpu:
            torch.cuda._sleep(int(gap_us * GPU_CYCLES_PER_US))
        while time.perf_counter() < end:  # busy, as a frontend's host is; a sleep would let
            pass  # the host idle and time its own wake-up too
        if gpu:
            torch.cuda.current_stream().synchronize()
        t0 = time.perf_counter()
        call(i)
        times.append((time.perf_counter() - t0) * 1e6)
    return times


# torch.cuda._sleep spins for a number of GPU cycles: about this many per us on an
# H100 or H200 under load (1.4-1.98 GHz), so the kernel ends about when the host's gap does
GPU_CYCLES_PER_US = 1500


def measure(
    client: ExpertClient, preset, m: int, reps: int, device: str, gap_us: float = 0.0
) -> dict:
    gen = torch.Generator().manual_seed(m)
    inputs = []
    for _ in range(4):
        x = torch.randn((m, preset.hidden_size), generator=gen).to(torch.bfloat16)
        ids, w = routing(m, preset, gen)
        inputs.append((x.to(device), ids.to(device), w.to(device)))
    endpoints = list(client._client._pool.endpoints.values())  # the shards' Timing per call
    for i in range(max(5, reps // 10)):
        client.forward(0, *inputs[i % 4])
    e2e, busiest, total, overhead = [], [], [], []
    before = client.timings()
    for i in range(reps):
        for ep in endpoints:
            ep.last_timing = None
        t0 = time.perf_counter()
        out = client.forward(0, *inputs[i % 4])
        if out.is_cuda:
            torch.cuda.current_stream().synchronize()
        t = (time.perf_counter() - t0) * 1e6
        client.synchronize()  # on-stream calls: the shard's Timing is in once it returns
        fwd = [_compute_us(ep.last_timing) for ep in endpoints if ep.last_timing is not None]
        e2e.append(t)
        busiest.append(max(fwd, default=0.0))
        total.append(sum(fwd))
        overhead.append(t - busiest[-1])
    stages = stage_means(before, client.timings())
    # calls issued back to back and waited for once, as a frontend that runs ahead of its
    # GPU issues them: the time per call (the same as e2e where forward waits for each)
    queued = max(10, reps // 4)
    t0 = time.perf_counter()
    for i in range(queued):
        out = client.forward(0, *inputs[i % 4])
    if out.is_cuda:
        torch.cuda.current_stream().synchronize()
    per_call = (time.perf_counter() - t0) * 1e6 / queued
    client.synchronize()

    def one(i: int) -> None:
        out = client.forward(0, *inputs[i % 4])
        if out.is_cuda:
            torch.cuda.current_stream().synchronize()

    before = client.timings()
    spaced = spaced_us(one, gap_us, queued, gpu=device == "cuda")
    client.synchronize()
    spaced_stages = stage_means(before, client.timings()) if spaced else {}
    stats = client.stats()
    row = _row(m, e2e, busiest, total, overhead, per_call, stats, spaced)
    row.update(
        stream_calls=sum(s["stream_calls"] for s in stats.values()),
        stages_mean_us=stages,
        spaced_stages_mean_us=spaced_stages,
    )
    return row


def _row(m: int, e2e, busiest, total, overhead, per_call: float, stats: dict, spaced=()) -> dict:
    """One row of results: percentiles of the calls' times (us)."""
    return {
        "M": m,
        "e2e_p50_us": pct(e2e, 0.5),
        "e2e_p99_us": pct(e2e, 0.99),
        "busiest_forward_p50_us": pct(busiest, 0.5),
        "sum_forward_p50_us": pct(total, 0.5),
        "overhead_p50_us": pct(overhead, 0.5),
        "overhead_p99_us": pct(overhead, 0.99),
        "queued_per_call_us": per_call,
        "spaced_e2e_p50_us": pct(spaced, 0.5) if spaced else None,
        "transports": sorted({s["transport"] for s in stats.values()}),
        "slot_memory": sorted({s["slot_memory"] for s in stats.values()} - {""}),
    }


def measure_graph(client: ExpertClient, preset, m: int, reps: int, gap_us: float = 0.0) -> dict:
    """`measure` for a call captured in a CUDA graph: e2e is one replay and the wait
    for it; the shards' Timing comes from `client.synchronize()` (GraphCalls.check)."""
    gen = torch.Generator().manual_seed(m)
    inputs = []
    for _ in range(4):
        x = torch.randn((m, preset.hidden_size), generator=gen).to(torch.bfloat16)
        ids, w = routing(m, preset, gen)
        inputs.append((x.cuda(), ids.cuda(), w.cuda()))
    static = [t.clone() for t in inputs[0]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager first, as before any capture
        client.forward(0, *static)
    side.synchronize()
    client.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        client.forward(0, *static)
    stream = torch.cuda.current_stream()
    endpoints = list(client._client._pool.endpoints.values())
    e2e, busiest, total, overhead = [], [], [], []
    for i in range(max(5, reps // 10) + reps):
        for dst, src in zip(static, inputs[i % 4], strict=True):
            dst.copy_(src)
        stream.synchronize()
        for ep in endpoints:
            ep.last_timing = None
        t0 = time.perf_counter()
        graph.replay()
        stream.synchronize()
        t = (time.perf_counter() - t0) * 1e6
        client.synchronize()
        if i < max(5, reps // 10):
            continue
        fwd = [_compute_us(ep.last_timing) for ep in endpoints if ep.last_timing is not None]
        e2e.append(t)
        busiest.append(max(fwd, default=0.0))
        total.append(sum(fwd))
        overhead.append(t - busiest[-1])
    queued = max(10, reps // 4)
    t0 = time.perf_counter()
    for _ in range(queued):
        graph.replay()
    stream.synchronize()
    per_call = (time.perf_counter() - t0) * 1e6 / queued
    client.synchronize()

    def one(i: int) -> None:
        graph.replay()
        stream.synchronize()

    spaced = spaced_us(one, gap_us, queued, gpu=True)
    client.synchronize()
    row = _row(m, e2e, busiest, total, overhead, per_call, client.stats(), spaced)
    row.update(stream_calls=0, stages_mean_us={})
    return row


# The client's stages shown per row (client/telemetry.py), where the time of a call goes.
STAGE_COLUMNS = (
    "stage",
    "route",
    "server_queue",
    "server_compute",
    "transfer",
    "doorbell",
    "wake",
    "sum",
)


def stage_means(before: dict, after: dict) -> dict:
    """Each client stage's mean (us) over the calls between two `client.timings()`."""
    out = {}
    for stage, a in after.items():
        b = before.get(stage, {"count": 0, "total_s": 0.0})
        n = a["count"] - b["count"]
        if n > 0:
            out[stage] = (a["total_s"] - b["total_s"]) / n * 1e6
    return out


def _compute_us(timing) -> float:
    if isinstance(timing, dict):
        return float(timing["compute_us"])
    return float(timing.compute_us)


def request_bytes(preset, m: int) -> tuple[int, int]:
    """A call's bytes: x + ids + weights out, the partial back."""
    h, k = preset.hidden_size, preset.top_k
    return m * (2 * h + 8 * k), 2 * m * h


@contextlib.contextmanager
def mps_daemon():
    """An MPS control daemon for the run, in a private pipe and log directory, named to
    this process (and so to the shards it starts) through CUDA_MPS_PIPE_DIRECTORY and
    CUDA_MPS_LOG_DIRECTORY. RuntimeError when nvidia-cuda-mps-control is not on PATH or
    does not start.

    At the end it is told to `quit` by a detached shell, which then removes the
    directories: `quit` returns only once the daemon's server has ended, and the server
    waits for every client to exit, this process included (it cannot give up its CUDA
    context before it exits)."""
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        raise RuntimeError("nvidia-cuda-mps-control is not on PATH")
    root = Path(tempfile.mkdtemp(prefix="expertd-mps-"))
    dirs = {"CUDA_MPS_PIPE_DIRECTORY": root / "pipe", "CUDA_MPS_LOG_DIRECTORY": root / "log"}
    for d in dirs.values():
        d.mkdir()
    saved = {k: os.environ.get(k) for k in dirs}
    os.environ.update({k: str(v) for k, v in dirs.items()})
    started = False
    try:
        run = subprocess.run([exe, "-d"], capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"{exe} -d failed: {(run.stderr or run.stdout).strip()}")
        started = True
        yield
    finally:
        if started:
            subprocess.Popen(
                ["sh", "-c", 'echo quit | "$0"; rm -rf "$1"', exe, str(root)],
                env=dict(os.environ),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        else:
            shutil.rmtree(root, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write JSON + PNG here")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--ms", default="1,16,256,4096")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--shards", default="1,8")
    ap.add_argument(
        "--gap-us",
        type=float,
        default=2000.0,
        help="the caller's own work before each 'spaced' call (0: no spaced calls)",
    )
    ap.add_argument("--transports", default=None, help="default: grpc,shm (+cuda-ipc on CUDA)")
    ap.add_argument(
        "--kind",
        default=None,
        help="the machine's name in the results (default: the GPU's, or cpu)",
    )
    ap.add_argument(
        "--serve-args",
        default="",
        help="more `expertd serve` flags for every shard (e.g. '--pin-slots off'); "
        "recorded in the JSON and named in its file name",
    )
    ap.add_argument(
        "--netns",
        action="store_true",
        help="shards (and the echo floors' far ends) in another network namespace, over a veth",
    )
    ap.add_argument(
        "--mps",
        action="store_true",
        help="run under an MPS control daemon started for the run (its own pipe and log "
        "directories; this process and every shard are its clients): processes sharing the "
        "GPU then run side by side instead of time-sliced (docs/operations.md)",
    )
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        if args.mps:  # before this process touches CUDA: its context must be an MPS client
            try:
                stack.enter_context(mps_daemon())
            except RuntimeError as e:
                print(f"--mps: {e}", file=sys.stderr)
                return 2
        return _main(args)


def _main(args) -> int:
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.kind is None:  # e.g. nvidia-h100-80gb-hbm3, as benchmarks/gpu_check.sh names it
        name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
        args.kind = "-".join(name.lower().split())
    far = None
    if args.netns:
        try:
            far = Far.create()
        except NetnsUnavailable as e:
            print(f"--netns: {e}", file=sys.stderr)
            return 2
    try:
        return run(args, far)
    finally:
        if far is not None:
            far.close()


ON_STREAM = "cuda-ipc-stream"
IN_GRAPH = "cuda-ipc-graph"  # the call captured in a CUDA graph, timed per replay


def run(args, far: Far | None) -> int:
    preset = get_preset(args.preset or ("muse-spark" if args.device == "cuda" else "small"))
    ms = [int(m) for m in args.ms.split(",")]
    shard_counts = [int(s) for s in args.shards.split(",")]
    with_nixl = nixl.available()
    default = "grpc,tcp,shm,nixl" if with_nixl else "grpc,tcp,shm"
    if args.device == "cuda":
        default += ",cuda-ipc"
    if far is not None:  # no shard on this host: no same-host plane
        default = ",".join(t for t in default.split(",") if t not in ("shm", "cuda-ipc"))
    if args.device != "cuda" and any(t in (args.transports or "") for t in (ON_STREAM, IN_GRAPH)):
        raise SystemExit(f"{ON_STREAM} and {IN_GRAPH} need --device cuda")
    transports = (args.transports or default).split(",")
    client_device = args.device
    common = [
        "--synthetic",
        preset.name,
        "--layers",
        "1",
        "--device",
        args.device,
        "--log-level",
        "WARNING",
        "--torch-threads",
        "1",
        "--max-tokens",
        str(max(4096, max(ms))),
        *args.serve_args.split(),
    ]

    floors = []
    bell = doorbell_us(max(args.reps, 500), shm.SPIN_S)
    for m in ms:
        out_b, back_b = request_bytes(preset, m)
        tcp = tcp_echo_us(out_b, back_b, args.reps, far)
        echo = grpc_echo_us(out_b, back_b, args.reps, far)
        d2d = d2d_us(out_b + back_b, args.reps)
        nixl_echo = nixl_echo_us(out_b, back_b, args.reps, far) if with_nixl else []
        # a GPU caller's NIXL slots are device memory at both ends: that echo too
        gpu_echo = []
        if with_nixl and args.device == "cuda" and "nixl" in transports:
            gpu_echo = nixl_echo_us(out_b, back_b, args.reps, far, on_gpu=True)
        floors.append(
            {
                "M": m,
                "bytes_out": out_b,
                "bytes_back": back_b,
                "tcp_echo_p50_us": pct(tcp, 0.5),
                "grpc_stream_echo_p50_us": pct(echo, 0.5),
                "shm_doorbell_p50_us": pct(bell, 0.5),
                "nixl_echo_p50_us": pct(nixl_echo, 0.5) if nixl_echo else None,
                "nixl_echo_p99_us": pct(nixl_echo, 0.99) if nixl_echo else None,
                "nixl_gpu_echo_p50_us": pct(gpu_echo, 0.5) if gpu_echo else None,
                "d2d_copy_p50_us": pct(d2d, 0.5) if d2d else None,
            }
        )
        print(json.dumps(floors[-1]), flush=True)

    rows = []
    for n in shard_counts:
        where = [] if far is None else ["--listen", f"{far.peer_addr}:0"]
        prefix = None if far is None else far.prefix
        procs = []
        try:
            for s in range(n):
                args_s = [*common, "--shard", str(s), "--num-shards", str(n), *where]
                procs.append(start_shard(args_s, prefix=prefix))
            wait_serving(procs, timeout=900)
            addresses = [p.address for p in procs]
            for transport in transports:
                # cuda-ipc-stream: cuda-ipc slots, calls queued on the caller's stream
                # cuda-ipc-graph: each M's call captured once, replayed
                on_stream = transport in (ON_STREAM, IN_GRAPH)
                plane = "cuda-ipc" if on_stream else transport
                kept = len(ms) if transport == IN_GRAPH else 0
                with ExpertClient(
                    addresses, transport=plane, on_stream=on_stream, graph_slots=kept
                ) as client:
                    for m in ms:
                        row = {"shards": n, "transport": transport}
                        if transport == IN_GRAPH:
                            row.update(measure_graph(client, preset, m, args.reps, args.gap_us))
                        else:
                            row.update(
                                measure(client, preset, m, args.reps, client_device, args.gap_us)
                            )
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        finally:
            stop_shards(procs)

    # gRPC's own cost for a call whose server is busy for the forward's length (the
    # stream's threads on both sides asleep meanwhile), beside each one-shard grpc row
    for r in rows:
        if r["transport"] == "grpc" and r["shards"] == 1:
            out_b, back_b = request_bytes(preset, r["M"])
            held = grpc_echo_us(out_b, back_b, args.reps, far, r["busiest_forward_p50_us"])
            r["grpc_held_echo_p50_us"] = pct(held, 0.5)

    result = {
        "date": dt.date.today().isoformat(),
        "kind": args.kind,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "cpus": os.cpu_count(),
        "preset": preset.name,
        "python": f"{sys.version.split()[0]}, grpcio {grpc.__version__}",
        "ucx_tls": os.environ.get("UCX_TLS", "(UCX's choice)"),
        "netns": None if far is None else repr(far),
        "serve_args": args.serve_args,
        "mps": args.mps,
        "reps": args.reps,
        "gap_us": args.gap_us,
        "floors": floors,
        "rows": rows,
    }
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tag = "".join(f"-{a.lstrip('-')}" for a in args.serve_args.split())
        tag += "-mps" if args.mps else ""
        stem = f"transport-{args.kind}{'-netns' if far else ''}{tag}-{result['date']}"
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        plot(result, out / f"{stem}.png")
    print_table(result)
    return 0


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 5))
    for n in sorted({r["shards"] for r in result["rows"]}):
        for t in sorted({r["transport"] for r in result["rows"]}):
            pts = [r for r in result["rows"] if r["shards"] == n and r["transport"] == t]
            if pts:
                ax.plot(
                    [r["M"] for r in pts], [r["e2e_p50_us"] for r in pts], "o-", label=f"{t}, {n}"
                )
    fl = result["floors"]
    ax.plot([f["M"] for f in fl], [f["tcp_echo_p50_us"] for f in fl], "k--", label="TCP echo")
    ax.plot([f["M"] for f in fl], [f["shm_doorbell_p50_us"] for f in fl], "k:", label="doorbell")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("e2e p50 (us)")
    ax.set_title(f"expertd transports, {result['preset']}, {result['kind']}")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


def print_table(result: dict) -> None:
    where = f", shards across a veth: {result['netns']}" if result.get("netns") else ""
    where += ", under MPS" if result.get("mps") else ""
    print(
        f"\nfloors ({result['kind']}, {result['cpus']} CPUs, {result['python']}{where}), p50 us:"
        f"\n{'M':>6} {'TCP echo':>9} {'grpc echo':>10} {'doorbell':>9} {'nixl echo':>10} "
        f"{'d2d':>7} {'nixl gpu':>9}"
    )
    for f in result["floors"]:
        d2d = f"{f['d2d_copy_p50_us']:7.1f}" if f["d2d_copy_p50_us"] is not None else "      -"
        ne = f.get("nixl_echo_p50_us")
        ne = f"{ne:10.0f}" if ne is not None else "         -"
        ng = f.get("nixl_gpu_echo_p50_us")
        ng = f"{ng:9.0f}" if ng is not None else "        -"
        print(
            f"{f['M']:>6} {f['tcp_echo_p50_us']:9.0f} {f['grpc_stream_echo_p50_us']:10.0f} "
            f"{f['shm_doorbell_p50_us']:9.1f} {ne} {d2d} {ng}"
        )
    tcp = {f["M"]: f["tcp_echo_p50_us"] for f in result["floors"]}
    print(
        f"\nservice ({result['preset']}; spaced: each call after {result.get('gap_us', 0):.0f} us "
        "of the caller's own work), us:\n"
        f"{'shards':>6} {'transport':>9} {'M':>6} "
        f"{'e2e p50':>8} {'e2e p99':>8} {'fwd max':>8} {'fwd sum':>8} {'ovh p50':>8} "
        f"{'ovh/TCP':>7} {'queued':>8} {'spaced':>8}"
    )
    for r in result["rows"]:
        queued = r.get("queued_per_call_us")
        print(
            f"{r['shards']:>6} {r['transport']:>9} {r['M']:>6} {r['e2e_p50_us']:8.0f} "
            f"{r['e2e_p99_us']:8.0f} {r['busiest_forward_p50_us']:8.0f} "
            f"{r['sum_forward_p50_us']:8.0f} {r['overhead_p50_us']:8.0f} "
            f"{r['overhead_p50_us'] / tcp[r['M']]:7.2f} "
            + (f"{queued:8.0f}" if queued is not None else f"{'-':>8}")
            + (f" {spaced:8.0f}" if (spaced := r.get("spaced_e2e_p50_us")) else f" {'-':>8}")
        )
    held = [r for r in result["rows"] if r.get("grpc_held_echo_p50_us") is not None]
    if held:
        echo = {f["M"]: f["grpc_stream_echo_p50_us"] for f in result["floors"]}
        print(
            "\ngrpc, one shard, against a grpc.aio stream echo: as is, and held (its server "
            "busy for the\nforward's p50 before each answer, that time taken off), p50 us:\n"
            f"{'M':>6} {'echo':>8} {'held':>8} {'ovh':>8} {'ovh/echo':>9} {'ovh/held':>9}"
        )
        for r in held:
            e, h, o = echo[r["M"]], r["grpc_held_echo_p50_us"], r["overhead_p50_us"]
            print(f"{r['M']:>6} {e:8.0f} {h:8.0f} {o:8.0f} {o / e:9.2f} {o / h:9.2f}")
    for key, what in (("stages_mean_us", "a call"), ("spaced_stages_mean_us", "a spaced call")):
        if not any(r.get(key) for r in result["rows"]):
            continue
        print(
            f"\nwhere {what} goes: the client's stages, mean us per call (client/telemetry.py; "
            "the server's and the wire's per shard attempt)\n"
            f"{'shards':>6} {'transport':>9} {'M':>6} "
            + " ".join(f"{c:>14}" for c in STAGE_COLUMNS)
        )
        for r in result["rows"]:
            st = r.get(key) or {}
            cells = " ".join(f"{st[c]:14.1f}" if c in st else f"{'-':>14}" for c in STAGE_COLUMNS)
            print(f"{r['shards']:>6} {r['transport']:>9} {r['M']:>6} {cells}")


if __name__ == "__main__":
    sys.exit(main())
