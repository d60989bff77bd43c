"""Library A/B: time whole kernel builds against each other in one device call.

A switch inside one build changes the code it is meant to compare (session 10: code that never
ran made the default 20-45% slower), so a change to a GEMM is measured as two libraries built
here (`EXPERTD_KERNEL_CACHE=/tmp/kcX python -m expertd.kernels.build`, then copied under
.carry/<name>/) and loaded in turn through EXPERTD_KERNEL_LIB. Each round runs
benchmarks/kernel.py once per library, in the order given, so every library sees the same
machine state; the table pairs each library with the first one of the same round.

    python benchmarks/lib_ab.py --lib old=.carry/A/libexpertd_kernels.so \
        --lib new=.carry/B/libexpertd_kernels.so --rounds 2 --ms 1,4,64 --out $OUT/ab
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel import parse_env  # benchmarks/kernel.py: the K=V,K=V switches of its --variant

ROOT = Path(__file__).resolve().parent.parent


def run_one(
    lib: str, ms: str, out: Path, env_extra: dict[str, str]
) -> tuple[dict[int, float], dict[int, float]]:
    """graph_us and the median SM clock (MHz, nan where not sampled) while it was timed, per M,
    of one benchmarks/kernel.py run on the library at `lib`. The clock matters from M = 16: the
    forward runs at the power limit there, and a hotter board holds it at a lower clock
    (session 21: one run's M = 1024 read 25% slower than the sweep's, cause not found)."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, EXPERTD_KERNEL_LIB=str(Path(lib).resolve()), **env_extra)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "kernel.py"), "--ms", ms, "--no-baseline"]
    cmd += ["--fixed-max", "0", "--bt-sweep-max", "0", "--dec-alt-max", "0", "--path-ab-max", "0"]
    cmd += ["--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"kernel.py failed on {lib}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    files = sorted(out.glob("kernel-*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise SystemExit(f"kernel.py wrote no results file under {out}")
    rows = json.loads(files[-1].read_text())["rows"]
    us = {int(r["M"]): float(r["graph_us"]) for r in rows}
    mhz = {
        int(r["M"]): float(r.get("graph_clocks", {}).get("sm_mhz_median", float("nan")))
        for r in rows
    }
    return us, mhz


def parse_libs(specs: list[str]) -> list[tuple[str, str]]:
    """--lib NAME=path values -> [(name, path)]; each path must be an existing file."""
    libs = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not Path(path).is_file():
            raise SystemExit(f"--lib {spec!r}: expected NAME=path to an existing library")
        libs.append((name, path))
    return libs


def print_ratios(ratios: list[dict], ms: list[int], base: str, what: str) -> None:
    """The table of pair_ratios' rows: one line per library and round, one column per M."""
    print(f"\nratio to {base} in the same round ({what}; < 1 = less than {base}):")
    print("lib     round " + " ".join(f"{m:>7d}" for m in ms))
    for row in ratios:
        r = row["ratio"]
        print(f"{row['lib']:6s}  {row['round']:5d} " + " ".join(f"{r[m]:7.3f}" for m in ms))


def pair_ratios(runs: list[tuple[int, str, dict[int, float]]], base: str) -> list[dict]:
    """Each run of a library other than `base`, as time / base's time in the same round, per M."""
    out = []
    for rnd, name, us in runs:
        if name == base:
            continue
        ref = next(u for r, n, u in runs if r == rnd and n == base)
        out.append({"round": rnd, "lib": name, "ratio": {m: us[m] / ref[m] for m in sorted(ref)}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--lib", action="append", required=True, help="NAME=path/to/libexpertd_kernels.so"
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ms", default="1,4,16,64,256,1024,4096")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/lib-ab"))
    ap.add_argument("--env", default="", help="kernel switches for every run, K=V,K=V")
    ap.add_argument(
        "--lib-env",
        action="append",
        default=[],
        help="NAME=K=V,K=V: switches for one library's runs only (the same path may be given "
        "twice under two names, once with a switch)",
    )
    args = ap.parse_args()

    libs = parse_libs(args.lib)
    env_extra = parse_env(args.env)
    lib_env = {}
    for spec in args.lib_env:
        name, sep, kvs = spec.partition("=")
        if not sep or name not in dict(libs):
            raise SystemExit(f"--lib-env {spec!r}: expected NAME=K=V,... for a NAME given to --lib")
        lib_env[name] = parse_env(kvs)
    out = Path(args.out)
    runs: list[tuple[int, str, dict[int, float]]] = []
    clocks: list[dict[int, float]] = []
    for rnd in range(args.rounds):
        for name, path in libs:
            env = {**env_extra, **lib_env.get(name, {})}
            us, mhz = run_one(path, args.ms, out / f"r{rnd}-{name}", env)
            runs.append((rnd, name, us))
            clocks.append(mhz)
            print(
                f"== {name:6s} "
                + " | ".join(f"{m} {t:.1f} ({mhz[m]:.0f} MHz)" for m, t in sorted(us.items())),
                flush=True,
            )

    base = libs[0][0]
    ms = sorted(runs[0][2])
    ratios = pair_ratios(runs, base)
    print_ratios(ratios, ms, base, "graph us")
    summary = {
        "libs": dict(libs),
        "lib_env": lib_env,
        "env": env_extra,
        "ms": ms,
        "runs": [
            {"round": rnd, "lib": name, "graph_us": us, "sm_mhz": mhz}
            for (rnd, name, us), mhz in zip(runs, clocks, strict=True)
        ],
        "ratios": ratios,
    }
    (out / "lib-ab.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
