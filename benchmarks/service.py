"""Service benchmark (docs/performance.md, "The service"): the real client against
8 real shard servers, next to what the busiest shard spent computing.

    python benchmarks/service.py --out $OUT [--device cuda] [--preset muse-spark] [--ms 1,16,256]

Reports, for the M sweep: end-to-end `ExpertClient.forward` latency (median),
the busiest shard's server-side compute time (from the responses' Timing:
staging + copies + kernels) split into host staging (gathering the batch into
the slot's packed pinned buffer) and device (one copy in, the forward, one copy
out, the wait for them), their ratio to end to end (the overhead of routing,
serialization, transport and copies), and the bytes moved per second against a
raw loopback TCP copy measured in the same run. Then unary vs the
bidirectional stream on one shard, and tokens/s under N concurrent clients with
cross-request batching on and off. Transport: TCP loopback (and a unix socket
for the unary/stream comparison). Prints a table last; writes JSON + PNG.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch

from expertd import wire
from expertd.client import ExpertClient
from expertd.launcher import start_shard, stop_shards, wait_serving
from expertd.server.config import shard_experts
from expertd.server.runner import CUDA_DEPTH
from expertd.server.synthetic import get_preset
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import expertd_pb2_grpc as pb_grpc

OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def socket_copy_gbps(total: int = 1 << 30, chunk: int = 8 << 20) -> float:
    """One-way bytes/s through a loopback TCP socket (the transport's raw ceiling here)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    payload = bytearray(chunk)

    def sink():
        conn, _ = server.accept()
        buf = bytearray(chunk)
        got = 0
        while got < total:
            n = conn.recv_into(buf)
            if not n:
                break
            got += n
        conn.sendall(b"k")
        conn.close()

    t = threading.Thread(target=sink)
    t.start()
    client = socket.create_connection(server.getsockname())
    start = time.perf_counter()
    sent = 0
    while sent < total:
        client.sendall(payload)
        sent += chunk
    client.recv(1)
    elapsed = time.perf_counter() - start
    client.close()
    t.join()
    server.close()
    return total / elapsed / 1e9


def routing(m: int, preset, gen):
    logits = torch.randn((m, preset.num_experts), generator=gen)
    top = logits.topk(preset.top_k, dim=1)
    return top.indices.to(torch.int32), torch.softmax(top.values, dim=1)


def per_shard_requests(preset, shards: int, x, ids, w):
    """What each shard gets for this call (the same split the client makes)."""
    reqs = []
    for s in range(shards):
        owned = torch.tensor(shard_experts(preset.num_experts, s, shards))
        mine = torch.isin(ids, owned)
        rows = mine.any(dim=1).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        sid = torch.where(mine[rows], ids[rows], torch.full_like(ids[rows], -1))
        sw = torch.where(mine[rows], w[rows], torch.zeros_like(w[rows]))
        reqs.append(
            (
                s,
                pb.ForwardRequest(
                    layer=0,
                    hidden_states=wire.encode(x[rows]),
                    topk_ids=wire.encode(sid),
                    topk_weights=wire.encode(sw),
                ),
            )
        )
    return reqs


def shard0_request(preset, m: int, gen) -> pb.ForwardRequest:
    """M tokens with 2 routes each, all to experts of shard 0 of 8."""
    owned = torch.tensor(shard_experts(preset.num_experts, 0, 8), dtype=torch.int32)
    ids = owned[torch.randint(0, owned.numel(), (m, 2), generator=gen)]
    x = torch.randn((m, preset.hidden_size), generator=gen).to(torch.bfloat16)
    return pb.ForwardRequest(
        layer=0,
        hidden_states=wire.encode(x),
        topk_ids=wire.encode(ids),
        topk_weights=wire.encode(torch.rand((m, 2), generator=gen)),
    )


def sweep(addresses, preset, ms, reps):
    gen = torch.Generator().manual_seed(0)
    stubs = [
        pb_grpc.ExpertServiceStub(grpc.insecure_channel(a, options=OPTIONS)) for a in addresses
    ]
    rows = []
    with ExpertClient(addresses, timeout=300) as client:
        for m in ms:
            x = torch.randn((m, preset.hidden_size), generator=gen).to(torch.bfloat16)
            ids, w = routing(m, preset, gen)
            client.forward(0, x, ids, w)  # warm-up
            e2e = []
            for _ in range(reps):
                t0 = time.perf_counter()
                client.forward(0, x, ids, w)
                e2e.append(time.perf_counter() - t0)
            busiest, parts = [], []
            reqs = per_shard_requests(preset, len(addresses), x, ids, w)
            for _ in range(reps):  # each shard alone, so its compute is not queued behind others
                timings = [stubs[s].Forward(r, timeout=300).timing for s, r in reqs]
                slowest = max(timings, key=lambda t: t.compute_us)
                busiest.append(slowest.compute_us)
                parts.append((slowest.stage_us, slowest.device_us, slowest.total_us))
            # Bytes on the wire: every request, and every shard's bf16 answer.
            moved = sum(
                r.ByteSize() + r.hidden_states.shape[0] * preset.hidden_size * 2 for _, r in reqs
            )
            t = statistics.median(e2e)
            c = statistics.median(busiest) / 1e6
            rows.append(
                {
                    "M": m,
                    "e2e_us": t * 1e6,
                    "busiest_compute_us": c * 1e6,
                    # of the busiest shard (median): host gathering, device + wait, all
                    "busiest_stage_us": statistics.median(p[0] for p in parts),
                    "busiest_device_us": statistics.median(p[1] for p in parts),
                    "busiest_server_total_us": statistics.median(p[2] for p in parts),
                    "overhead_x": t / c if c else None,
                    "bytes": moved,
                    "GBps": moved / t / 1e9,
                    "tokens_per_s": m / t,
                }
            )
            print(f"M={m}: e2e {t * 1e6:.0f} us, busiest shard {c * 1e6:.0f} us", flush=True)
    return rows


def unary_vs_stream(address, preset, ms, reps):
    gen = torch.Generator().manual_seed(1)
    out = []
    with grpc.insecure_channel(address, options=OPTIONS) as ch:
        stub = pb_grpc.ExpertServiceStub(ch)
        for m in ms:
            req = shard0_request(preset, m, gen)
            stub.Forward(req, timeout=60)
            unary = []
            for _ in range(reps):
                t0 = time.perf_counter()
                stub.Forward(req, timeout=60)
                unary.append(time.perf_counter() - t0)
            stream = stream_round_trips(stub, req, reps)
            out.append(
                {
                    "M": m,
                    "unary_us": statistics.median(unary) * 1e6,
                    "stream_us": statistics.median(stream) * 1e6,
                }
            )
            print(
                f"M={m}: unary {out[-1]['unary_us']:.0f} us, stream {out[-1]['stream_us']:.0f} us",
                flush=True,
            )
    return out


def stream_round_trips(stub, req: pb.ForwardRequest, reps: int) -> list[float]:
    """One long-lived ForwardStream, one request in flight at a time (the unary pattern)."""
    answered = threading.Semaphore(0)

    def requests():
        for i in range(reps + 1):
            if i:
                answered.acquire()  # wait for the previous answer
            r = pb.ForwardRequest()
            r.CopyFrom(req)
            r.request_id = i
            yield r

    times, t0 = [], time.perf_counter()
    for n, _resp in enumerate(stub.ForwardStream(requests(), timeout=120)):
        now = time.perf_counter()
        if n:
            times.append(now - t0)
        t0 = now
        answered.release()
    return times


def throughput(address, preset, m, clients, seconds):
    """Tokens/s of `clients` threads hammering one shard with M-token requests."""
    gen = torch.Generator().manual_seed(2)
    req = shard0_request(preset, m, gen)
    stop = time.perf_counter() + seconds
    counts = [0] * clients

    def work(i):
        with grpc.insecure_channel(
            address, options=[*OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        ) as ch:
            stub = pb_grpc.ExpertServiceStub(ch)
            while time.perf_counter() < stop:
                stub.Forward(req, timeout=60)
                counts[i] += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(work, range(clients)))
    return sum(counts) * m / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--ms", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kind", default="nvidia-h200" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--pipeline-depth", type=int, default=None, help="shards' batches in flight")
    args = ap.parse_args()
    preset = get_preset(args.preset or ("muse-spark" if args.device == "cuda" else "small"))
    ms = [int(m) for m in args.ms.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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
        "2",
        "--max-tokens",
        str(max(16384, max(ms))),
    ]
    if args.pipeline_depth is not None:
        common += ["--pipeline-depth", str(args.pipeline_depth)]
    raw = socket_copy_gbps()
    print(f"raw loopback TCP copy: {raw:.2f} GB/s", flush=True)
    shards = [start_shard([*common, "--shard", str(s), "--num-shards", "8"]) for s in range(8)]
    extra = [
        start_shard([*common, "--shard", "0", "--num-shards", "8", "--max-batch-requests", "1"]),
        start_shard(
            [
                *common,
                "--shard",
                "0",
                "--num-shards",
                "8",
                "--listen",
                f"unix:/tmp/expertd-bench-{os.getpid()}.sock",
            ]
        ),
    ]
    try:
        wait_serving(shards + extra, timeout=900)
        addresses = [s.address for s in shards]
        rows = sweep(addresses, preset, ms, args.reps)
        transport = {
            "tcp": unary_vs_stream(addresses[0], preset, [16, 1024], 20),
            "unix": unary_vs_stream(extra[1].address, preset, [16, 1024], 20),
        }
        batching = []
        for n in (1, 8, 32):
            on = throughput(addresses[0], preset, 16, n, args.seconds)
            off = throughput(extra[0].address, preset, 16, n, args.seconds)
            batching.append(
                {"clients": n, "M": 16, "batching_on_tok_s": on, "batching_off_tok_s": off}
            )
            print(
                f"{n} clients x M=16: batching on {on:.0f} tok/s, off {off:.0f} tok/s", flush=True
            )
    finally:
        stop_shards(shards + extra)
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    result = {
        "date": dt.date.today().isoformat(),
        "kind": args.kind,
        "device": device_name,
        "preset": preset.name,
        "shards": 8,
        "transport": "TCP loopback (8 shard processes on one host)",
        # What the shards' serving path was (server/runner.py): compare runs only alike.
        "server_path": {
            "copies": "one packed H2D and one packed D2H per batch, on their own streams",
            "batches_in_flight": args.pipeline_depth
            or (CUDA_DEPTH if args.device == "cuda" else 1),
            "host_staging": "numpy into pinned buffers",
        },
        "raw_socket_GBps": raw,
        "rows": rows,
        "unary_vs_stream": transport,
        "batching": batching,
    }
    name = f"service-{args.kind}-{result['date']}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.loglog(
            [r["M"] for r in rows],
            [r["e2e_us"] for r in rows],
            "o-",
            label="client.forward, 8 shards",
        )
        ax.loglog(
            [r["M"] for r in rows],
            [r["busiest_compute_us"] for r in rows],
            "s--",
            label="busiest shard compute",
        )
        ax.loglog(
            [r["M"] for r in rows],
            [max(r["busiest_stage_us"], 1) for r in rows],
            "^:",
            label="of which host staging",
        )
        ax.set_xlabel("tokens M")
        ax.set_ylabel("us")
        ax.set_title(f"expertd service, {preset.name}, {device_name}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.savefig(out / f"{name}.png", dpi=120, bbox_inches="tight")
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
    print(
        f"\nexpertd service: {preset.name}, 8 shards on {device_name}, TCP loopback; raw socket {raw:.2f} GB/s"
    )
    print(
        f"{'M':>6} | {'e2e us':>9} | {'shard us':>9} | {'(stage)':>8} | {'(device)':>9} | "
        f"{'overhead':>8} | {'GB/s':>6} | {'of raw':>6} | {'tok/s':>9}"
    )
    for r in rows:
        print(
            f"{r['M']:>6} | {r['e2e_us']:>9.0f} | {r['busiest_compute_us']:>9.0f} | "
            f"{r['busiest_stage_us']:>8.0f} | {r['busiest_device_us']:>9.0f} | "
            f"{r['overhead_x']:>7.2f}x | {r['GBps']:>6.2f} | {r['GBps'] / raw:>6.1%} | "
            f"{r['tokens_per_s']:>9.0f}"
        )
    for kind, vals in transport.items():
        for v in vals:
            print(
                f"{kind} M={v['M']}: unary {v['unary_us']:.0f} us, stream {v['stream_us']:.0f} us"
            )
    for b in batching:
        print(
            f"{b['clients']:>2} clients, M=16: batching on {b['batching_on_tok_s']:.0f} tok/s, "
            f"off {b['batching_off_tok_s']:.0f} tok/s ({b['batching_on_tok_s'] / b['batching_off_tok_s']:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
