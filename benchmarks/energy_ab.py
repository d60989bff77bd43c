"""Library A/B in energy: joules per call of whole kernel builds, back to back, on the device.

From M = 16 the forward runs at the H200's 700 W power limit (session 21), so a call's time
there is its energy over the limit and a change that saves energy saves time in any loop that
keeps the GPU busy, even where lib_ab.py's burst timing shows less. Each round runs
benchmarks/clock_watch.py once per library (graph replays of the same input sets: one seed,
drawn in the order of --ms; NVML's energy counter around --seconds of calls per M), in the
given order in even rounds and reversed in odd ones (A B, B A, ...), so a drift of the clock or
the temperature over the run falls on both sides; each library is paired with the first one
of the same round, in mJ and in us per call.

    python benchmarks/energy_ab.py --lib old=.carry/A/libexpertd_kernels.so \
        --lib new=.carry/B/libexpertd_kernels.so --rounds 2 --ms 512,1024 --out $OUT/eab
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib_ab import pair_ratios, parse_libs, print_ratios

ROOT = Path(__file__).resolve().parent.parent


def run_one(lib: str, ms: str, seconds: float, out: Path) -> dict[int, dict[str, float]]:
    """{M: {"mj": mJ per call, "us": us per call}} of one clock_watch.py run on `lib`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, EXPERTD_KERNEL_LIB=str(Path(lib).resolve()))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "clock_watch.py"), "--ms", ms]
    cmd += ["--seconds", str(seconds), "--no-rates", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"clock_watch.py failed on {lib}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    return per_m(json.loads(out.read_text())["rows"])


def per_m(rows: list[dict]) -> dict[int, dict[str, float]]:
    """clock_watch rows -> {M: {"mj", "us"}} (the forward rows only; idle / rates skipped)."""
    got = {}
    for r in rows:
        if "m" in r and not r.get("env"):
            got[int(r["m"])] = {"mj": float(r["mj_per_call"]), "us": float(r["us_per_call"])}
    return got


def round_order(libs: list, rnd: int) -> list:
    """The libraries of round `rnd`: as given in even rounds, reversed in odd ones."""
    return libs if rnd % 2 == 0 else libs[::-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--lib", action="append", required=True, help="NAME=path/to/libexpertd_kernels.so"
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ms", default="512,1024,2048")
    ap.add_argument("--seconds", type=float, default=3.0, help="per M and library")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/energy-ab"))
    args = ap.parse_args()

    libs = parse_libs(args.lib)
    out = Path(args.out)
    runs = []
    for rnd in range(args.rounds):
        for name, path in round_order(libs, rnd):
            got = run_one(path, args.ms, args.seconds, out / f"r{rnd}-{name}.json")
            runs.append((rnd, name, got))
            print(
                f"== r{rnd} {name:6s} "
                + " | ".join(
                    f"{m} {v['mj']:.1f} mJ {v['us']:.1f} us" for m, v in sorted(got.items())
                ),
                flush=True,
            )

    base = libs[0][0]
    ms = sorted(runs[0][2])
    tables = {}
    for key, unit in (("mj", "mJ per call"), ("us", "us per call")):
        ratios = pair_ratios([(r, n, {m: v[key] for m, v in g.items()}) for r, n, g in runs], base)
        tables[key] = ratios
        print_ratios(ratios, ms, base, unit)
    summary = {
        "libs": dict(libs),
        "ms": ms,
        "seconds": args.seconds,
        "runs": [{"round": r, "lib": n, "per_m": g} for r, n, g in runs],
        "ratios_mj": tables["mj"],
        "ratios_us": tables["us"],
    }
    (out / "energy-ab.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
