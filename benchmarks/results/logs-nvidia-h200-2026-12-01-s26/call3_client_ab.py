"""Session 26: two client trees against the same 8 muse-spark shard servers, alternating.

    python3 client_ab.py --trees old=/tmp/oldsite:/tmp/site new=/tmp/site --ms 16,64,256 --rounds 2

The shards start once (this tree's launcher); each (round, tree) runs the sync ExpertClient in
its own process with that tree on PYTHONPATH, run from /tmp so the checkout does not shadow it:
e2e median / mean / p90 per M and the client process's CPU time per call.
"""

import argparse
import json
import os
import subprocess
import sys

CLIENT = r"""
import json, resource, statistics, sys, time
import torch
import expertd.client.core as core
from expertd.client import ExpertClient
from expertd.server.synthetic import get_preset
addresses, ms, reps = sys.argv[1].split(","), [int(m) for m in sys.argv[2].split(",")], int(sys.argv[3])
preset = get_preset(sys.argv[4])
gen = torch.Generator().manual_seed(0)
rows = []
with ExpertClient(addresses, timeout=300) as client:
    for m in ms:
        x = torch.randn((m, preset.hidden_size), generator=gen).to(torch.bfloat16)
        ids = torch.rand((m, preset.num_experts), generator=gen).topk(8, dim=1).indices.int()
        w = torch.rand((m, 8), generator=gen)
        w = w / w.sum(1, keepdim=True)
        for _ in range(5):
            client.forward(0, x, ids, w)
        e2e = []
        c0 = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(reps):
            t0 = time.perf_counter()
            client.forward(0, x, ids, w)
            e2e.append(time.perf_counter() - t0)
        c1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime) / reps
        e2e.sort()
        rows.append({"M": m, "median_us": statistics.median(e2e) * 1e6,
                     "mean_us": statistics.mean(e2e) * 1e6, "p90_us": e2e[int(0.9 * reps)] * 1e6,
                     "cpu_us_per_call": cpu * 1e6})
print(json.dumps({"module": core.__file__, "rows": rows}))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", nargs="+", required=True, help="NAME=PYTHONPATH")
    ap.add_argument("--ms", default="16,64,256")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="muse-spark")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    from expertd.server.launcher import start_shard, stop_shards, wait_serving

    common = [
        "--synthetic",
        args.preset,
        "--layers",
        "1",
        "--device",
        args.device,
        "--log-level",
        "WARNING",
        "--torch-threads",
        "2",
        "--max-tokens",
        "16384",
    ]
    shards = [start_shard([*common, "--shard", str(s), "--num-shards", "8"]) for s in range(8)]
    trees = [t.split("=", 1) for t in args.trees]
    results = []
    try:
        wait_serving(shards, timeout=900)
        addrs = ",".join(s.address for s in shards)
        for rnd in range(args.rounds):
            for name, path in trees if rnd % 2 == 0 else trees[::-1]:
                env = {**os.environ, "PYTHONPATH": path}
                p = subprocess.run(
                    [sys.executable, "-c", CLIENT, addrs, args.ms, str(args.reps), args.preset],
                    env=env,
                    cwd="/tmp",
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                if p.returncode:
                    print(p.stderr[-3000:])
                    raise SystemExit(f"{name} failed")
                doc = json.loads(p.stdout.strip().splitlines()[-1])
                for r in doc["rows"]:
                    print(
                        f"round {rnd} {name:4s} M={r['M']:5d}: median {r['median_us']:7.0f} "
                        f"mean {r['mean_us']:7.0f} p90 {r['p90_us']:7.0f} us, "
                        f"client CPU {r['cpu_us_per_call']:6.0f} us/call",
                        flush=True,
                    )
                results.append({"round": rnd, "tree": name, **doc})
    finally:
        stop_shards(shards)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
