"""Where a lone request's time goes inside one shard process, step by step.

    python benchmarks/server_trace.py --out $OUT [--m 1] [--seconds 8] [--device cuda]

Runs `expertd serve` (preset muse-spark, 1 layer, shard 0 of 8) in this process with
timestamps taken at each step of a request, while a client process sends it requests of
M tokens back to back over TCP loopback. Steps (medians over the requests, in us):

  deser     the request's bytes handed to our deserializer (gRPC's part is before it)
  handler   ExpertServicer.Forward entered
  parsed    the request validated (server/validate.py)
  start     the batch starts (on the loop: `_run_here`; else the compute thread)
  launched  BatchRunner.launch returned (gathered, queued on the GPU)
  waited    its results are on the host
  finished  the responses are encoded
  settled   the callers' futures are set
  reply     Forward returns the response to gRPC

and the client's round trip, of which "outside" is what no step above covers (the two
gRPC stacks, the sockets, the client's Python). Writes JSON; prints a table last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

STEPS = ("deser", "handler", "parsed", "start", "launched", "waited", "finished", "settled")


def client(address: str, preset_name: str, m: int, seconds: float, out: str) -> None:
    import grpc
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from service import OPTIONS, shard0_request

    from expertd.server.synthetic import get_preset
    from expertd.v1 import expertd_pb2_grpc as pb_grpc

    req = shard0_request(get_preset(preset_name), m, torch.Generator().manual_seed(0))
    with grpc.insecure_channel(address, options=OPTIONS) as ch:
        stub = pb_grpc.ExpertServiceStub(ch)
        grpc.channel_ready_future(ch).result(timeout=600)
        while True:  # until the shard serves
            try:
                stub.Forward(req, timeout=60)
                break
            except grpc.RpcError:
                time.sleep(0.5)
        for _ in range(100):
            stub.Forward(req, timeout=60)
        rtt, t0 = [], time.time()
        while time.time() - t0 < seconds:
            t = time.perf_counter_ns()
            stub.Forward(req, timeout=60)
            rtt.append(time.perf_counter_ns() - t)
    Path(out).write_text(json.dumps(rtt))


def instrument(events: list) -> None:
    """Wrap the request path's steps so each appends (step, perf_counter_ns)."""
    from expertd.server import batcher, malformed, runner, service

    def after(owner, name: str, step: str) -> None:
        fn = getattr(owner, name)

        def wrapped(*a, **kw):
            result = fn(*a, **kw)
            events.append((step, time.perf_counter_ns()))
            return result

        setattr(owner, name, wrapped)

    def before(owner, name: str, step: str) -> None:
        fn = getattr(owner, name)

        def wrapped(*a, **kw):
            events.append((step, time.perf_counter_ns()))
            return fn(*a, **kw)

        setattr(owner, name, wrapped)

    lenient = malformed._lenient

    def traced_lenient(deserializer):
        parse = lenient(deserializer)

        def first(data):
            events.append(("deser", time.perf_counter_ns()))
            return parse(data)

        return first

    malformed._lenient = traced_lenient
    forward = service.ExpertServicer.Forward

    async def traced_forward(self, request, context):
        events.append(("handler", time.perf_counter_ns()))
        reply = await forward(self, request, context)
        events.append(("reply", time.perf_counter_ns()))
        return reply

    service.ExpertServicer.Forward = traced_forward
    after(service, "parse_forward", "parsed")
    before(batcher.Batcher, "_run_here", "start")
    before(batcher.Batcher, "_launch", "start")
    after(runner.BatchRunner, "launch", "launched")
    after(runner.Flight, "wait", "waited")
    after(batcher.Batcher, "_finish", "finished")
    after(batcher, "_settle", "settled")


def segments(events: list) -> list[dict]:
    """Split the event stream at each "deser" into requests with every step once."""
    out, cur = [], None
    for step, t in events:
        if step == "deser":
            cur = {"deser": t}
            out.append(cur)
        elif cur is not None and step not in cur:
            cur[step] = t
    return [r for r in out if all(s in r for s in (*STEPS, "reply"))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--preset", default="muse-spark")
    ap.add_argument("--device", default=None)
    ap.add_argument("--port", type=int, default=50991)
    ap.add_argument("--tag", default="")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rtt-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    address = f"127.0.0.1:{args.port}"
    if args.client:
        client(address, args.preset, args.m, args.seconds, args.rtt_file)
        return 0
    import torch

    from expertd.cli import main as cli_main

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    events: list = []
    instrument(events)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rtt_file = out / f".rtt-{os.getpid()}.json"
    client_args = ["--client", "--m", str(args.m), "--seconds", str(args.seconds)]
    client_args += ["--preset", args.preset, "--port", str(args.port), "--rtt-file", str(rtt_file)]
    proc = subprocess.Popen([sys.executable, __file__, *client_args])

    def stop_when_done() -> None:
        proc.wait()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_done, daemon=True).start()
    serve = ["serve", "--synthetic", args.preset, "--layers", "1", "--shard", "0"]
    serve += ["--num-shards", "8", "--device", device, "--listen", address]
    cli_main([*serve, "--log-level", "WARNING", "--drain-delay", "0", "--grace", "1"])
    rtt = json.loads(rtt_file.read_text())
    rtt_file.unlink()
    reqs = segments(events)[-len(rtt) :]  # the timed requests are the last ones
    names = (*STEPS, "reply")
    steps = {
        f"{a}->{b}": statistics.median((r[b] - r[a]) / 1e3 for r in reqs)
        for a, b in itertools.pairwise(names)
    }
    inside = statistics.median((r["reply"] - r["deser"]) / 1e3 for r in reqs)
    round_trip = statistics.median(rtt) / 1e3
    result = {
        "date": dt.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "preset": args.preset,
        "M": args.m,
        "requests": len(reqs),
        "steps_us": steps,
        "deser_to_reply_us": inside,
        "round_trip_us": round_trip,
        "outside_us": round_trip - inside,
    }
    name = f"server-trace-{'cuda' if device.startswith('cuda') else 'cpu'}-{result['date']}"
    (out / f"{name}-m{args.m}{args.tag}.json").write_text(json.dumps(result, indent=1))
    print(f"\none shard, M = {args.m}, {result['device']}: medians in us over {len(reqs)} requests")
    for key, value in steps.items():
        print(f"  {key:<20} {value:8.1f}")
    print(f"  {'deser->reply':<20} {inside:8.1f}")
    print(f"  {'round trip':<20} {round_trip:8.1f}  (outside the steps: {round_trip - inside:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
