"""Soak: the long version of tests/reliability/test_reliability_*.py. N callers for a fixed
time against real shard processes, every result checked against the reference,
faults injected on a schedule, server memory sampled throughout.

    python benchmarks/soak.py [--duration 150] [--threads 32 --tasks 32]
        [--faults kill:20,reset:50,slow:80,kill:110] [--hold 5] [--out benchmarks/results]

Shards 0..N-1 of the `small` preset (CPU by default), plus a second replica of
each shard in --replicas; every replica of those sits behind a fault proxy
(tests/faultproxy.py). A fault hits one replica, round robin, for --hold s:
`kill` = kill -9 then restart on the same address, `reset` / `stall` / `slow`
= the proxy breaks its link. With replicas the expected outcome is no error at
all (`stall` is a known client weakness: see the report). Prints a table last;
writes JSON to --out as soak-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the load generator and proxy the tests use

from faultproxy import FaultProxy  # noqa: E402
from loadgen import make_cases, rss_mib, run_load  # noqa: E402

from expertd.launcher import start_shard, stop_shards, wait_serving  # noqa: E402
from expertd.server.synthetic import get_preset, synthetic_layer  # noqa: E402


def parse_faults(text: str) -> list[tuple[str, float]]:
    out = []
    for item in filter(None, text.split(",")):
        kind, _, at = item.partition(":")
        if kind not in ("kill", "reset", "stall", "slow"):
            raise SystemExit(f"unknown fault {kind!r} (kill, reset, stall, slow)")
        out.append((kind, float(at)))
    return sorted(out, key=lambda f: f[1])


class Fleet:
    """The shard processes, by name ('s3', 'r0' = replica of shard 0), and the proxies."""

    def __init__(self, args) -> None:
        self.args = args
        names = [f"s{s}" for s in range(args.shards)] + [f"r{s}" for s in args.replicas]
        self.procs = {n: start_shard(self.serve_args(n)) for n in names}
        wait_serving(list(self.procs.values()), timeout=600)
        replicated = [n for n in names if int(n[1:]) in args.replicas]
        self.proxies = {n: FaultProxy(self.procs[n].address) for n in replicated}
        self.victims = replicated  # faults go round these
        self.rss: list[dict] = []  # samples: {"t": s, name: MiB, ...}

    def serve_args(self, name: str, listen: str = "127.0.0.1:0") -> list[str]:
        a = self.args
        return [
            *(
                "--synthetic",
                a.preset,
                "--layers",
                "1",
                "--seed",
                str(a.seed),
                "--device",
                a.device,
            ),
            *("--shard", name[1:], "--num-shards", str(a.shards), "--listen", listen),
            *("--torch-threads", "1"),
        ]

    @property
    def addresses(self) -> list[str]:
        return [
            self.proxies[n].address if n in self.proxies else p.address
            for n, p in self.procs.items()
        ]

    def sample(self, t: float) -> None:
        row = {"t": round(t, 1)}
        for name, p in list(self.procs.items()):
            with contextlib.suppress(OSError, RuntimeError):  # just killed by a fault: no sample
                row[name] = round(rss_mib(p.process.pid), 1)
        self.rss.append(row)

    def fault(self, kind: str, victim: str, hold: float) -> None:
        proxy = self.proxies[victim]
        if kind == "kill":
            old = self.procs[victim]
            os.kill(old.process.pid, signal.SIGKILL)
            old.process.wait()
            time.sleep(hold)
            self.procs[victim] = start_shard(self.serve_args(victim, old.address))
            wait_serving([self.procs[victim]], timeout=120)
            return
        {"reset": proxy.reset, "stall": proxy.stall, "slow": lambda: proxy.slow(0.05)}[kind]()
        time.sleep(hold)
        proxy.heal()

    def stop(self) -> None:
        for proxy in self.proxies.values():
            proxy.close()
        stop_shards(list(self.procs.values()), timeout=30)


def run(args) -> dict:
    preset = get_preset(args.preset)
    t0 = time.monotonic()
    layer = synthetic_layer(preset, args.seed, 0, list(range(preset.num_experts)))
    cases = make_cases([layer], args.cases, seed=args.seed)
    fleet = Fleet(args)
    print(
        f"{len(fleet.procs)} shard processes serving after {time.monotonic() - t0:.1f} s",
        flush=True,
    )
    schedule = parse_faults(args.faults)
    events: list[dict] = []
    start = time.monotonic()
    stop = threading.Event()

    def sampler() -> None:
        while not stop.wait(args.sample_s):
            fleet.sample(time.monotonic() - start)

    def faults() -> None:
        for i, (kind, at) in enumerate(schedule):
            time.sleep(max(at - (time.monotonic() - start), 0))
            victim = fleet.victims[i % len(fleet.victims)]
            began = time.monotonic() - start
            fleet.fault(kind, victim, args.hold)
            events.append(
                {
                    "fault": kind,
                    "victim": victim,
                    "at_s": round(began, 1),
                    "took_s": round(time.monotonic() - start - began, 1),
                }
            )
            print(f"  fault {kind} on {victim} at {began:.0f} s done", flush=True)

    fleet.sample(0.0)
    threading.Thread(target=sampler, daemon=True).start()
    try:
        tally, seconds = run_load(
            fleet.addresses,
            cases,
            args.duration,
            threads=args.threads,
            tasks=args.tasks,
            during=faults,
            timeout=args.timeout,
        )
    finally:
        stop.set()
        fleet.stop()
    summary = tally.summary(seconds)
    warm = next((r for r in fleet.rss if r["t"] >= args.warmup_s), fleet.rss[0])
    last = fleet.rss[-1]
    growth = {n: round(last[n] - warm[n], 1) for n in last if n != "t" and n in warm}
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {args.device}",
        "date": dt.date.today().isoformat(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "summary": summary,
        "wrong_results": tally.wrong[:20],
        "error_samples": tally.samples[:10],
        "faults": events,
        "rss_mib": fleet.rss,
        "rss_growth_after_warmup_mib": growth,
    }


def table(result: dict) -> str:
    s, g = result["summary"], result["rss_growth_after_warmup_mib"]
    c = result["config"]
    rows = [
        ("machine", result["machine"]),
        ("callers", f"{c['threads']} threads + {c['tasks']} asyncio tasks, {c['duration']:.0f} s"),
        ("calls (ok / errors)", f"{s['calls']} ({s['ok']} / {s['errors']})"),
        ("wrong results", s["wrong"]),
        ("error kinds", s["error_kinds"] or "-"),
        ("latency p50 / p99 ms", f"{s['p50_ms']} / {s['p99_ms']}"),
        ("tokens/s", s["tokens_per_s"]),
        ("faults", ", ".join(f"{e['fault']}@{e['at_s']:.0f}s" for e in result["faults"]) or "-"),
        ("RSS growth after warm-up MiB", f"max {max(g.values(), default=0):+.1f}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)} | {v}" for k, v in rows)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration", type=float, default=150.0, help="seconds of load")
    p.add_argument("--threads", type=int, default=32, help="callers on threads (4 ExpertClients)")
    p.add_argument("--tasks", type=int, default=32, help="asyncio callers (one AsyncExpertClient)")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--replicas", default="0,1", help="shards that get a second replica")
    p.add_argument("--faults", default="kill:20,reset:50,slow:80,kill:110", help="kind:at_s,...")
    p.add_argument("--hold", type=float, default=5.0, help="how long each fault lasts, s")
    p.add_argument("--timeout", type=float, default=30.0, help="each call's deadline, s")
    p.add_argument("--cases", type=int, default=128, help="distinct calls in the pool")
    p.add_argument("--sample-s", type=float, default=5.0, help="RSS sampling period")
    p.add_argument("--warmup-s", type=float, default=10.0, help="RSS growth counted from here")
    p.add_argument("--preset", default="small")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    args.replicas = [int(s) for s in filter(None, args.replicas.split(","))]
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"soak-{args.device}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    print(table(result))
    sys.exit(0 if result["summary"]["wrong"] == 0 else 1)


if __name__ == "__main__":
    main()
