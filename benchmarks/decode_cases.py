"""Decode calls with a chosen number of hit local experts, default against switches.

benchmarks/kernel.py draws real top-8 routing, so its M = 1 averages calls that hit 0, 1, 2 or
3 of the shard's experts. A change aimed at one of those (e.g. block placement when one expert
is hit) must not cost the others: this times each case alone, graphs of the default against
graphs captured under each --variant in alternating runs (benchmarks/kernel.py's pairing).

    python benchmarks/decode_cases.py --cases 1:0,1:1,1:2,1:3,2:2 \
        --variant pad:EXPERTD_KERNEL_SMEM1=81920 [--out $OUT]

A case M:T is M tokens whose routes hit T distinct local experts once each (T <= min(8 M, 32));
the other routes go to experts of other shards.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from math import comb
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel as kb  # benchmarks/kernel.py: the layer, graphs, paired timing

from expertd.kernels.cuda import CudaBackend


def case_inputs(m: int, t: int, gen: torch.Generator, device: str = "cuda"):
    """x, topk_ids, topk_weights for M tokens with T local routes on T distinct experts (on
    `device`, drawn with `gen`, a generator of that device)."""
    if not 0 <= t <= min(kb.TOP_K * m, kb.EL):
        raise SystemExit(f"case {m}:{t}: T must be in [0, min(8 M, 32)]")
    local = list(kb.LOCAL_EXPERTS)
    other = [e for e in range(kb.E) if e not in local]
    picks = torch.randperm(len(local), generator=gen, device=device)[:t].tolist()
    ids = torch.empty((m, kb.TOP_K), dtype=torch.int32)
    for tok in range(m):
        foreign = torch.randperm(len(other), generator=gen, device=device)[: kb.TOP_K].tolist()
        ids[tok] = torch.tensor([other[f] for f in foreign], dtype=torch.int32)
    for n in range(t):  # local route n: token n % M, slot n // M (distinct experts)
        ids[n % m, n // m] = local[picks[n]]
    w = torch.rand((m, kb.TOP_K), generator=gen, device=device)
    x = torch.randn((m, kb.H), generator=gen, device=device).to(torch.bfloat16)
    return x, ids.to(device), (w / w.sum(dim=1, keepdim=True)).float()


def m1_expectation(rows: list[dict], names: list[str]) -> dict | None:
    """M = 1 under uniform top-8 routing hits T of the shard's 32 experts with the
    hypergeometric probability C(32, T) C(224, 8 - T) / C(256, 8) (T = 0-3: 99% of calls): the
    expected graph time of the default and of each variant over the M = 1 cases measured."""
    m1 = {r["local_experts_hit"]: r for r in rows if r["M"] == 1}
    if not m1:
        return None
    p = {t: comb(kb.EL, t) * comb(kb.E - kb.EL, kb.TOP_K - t) / comb(kb.E, kb.TOP_K) for t in m1}
    norm = sum(p.values())
    exp = {"default": sum(p[t] * m1[t]["graph_us"] for t in m1) / norm}
    for name in names:
        exp[name] = sum(p[t] * m1[t]["variants"][name]["graph_us"] for t in m1) / norm
    line = ", ".join(f"{k} {v:.2f} us ({v / exp['default']:.3f})" for k, v in exp.items())
    print(f"M=1 expected over T = {sorted(m1)} (probability covered {norm:.3f}): {line}")
    return {"cases": sorted(m1), "probability": norm, "graph_us": exp}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", default="1:0,1:1,1:2,1:3")
    ap.add_argument("--variant", action="append", default=[], help="NAME:K=V,K=V")
    ap.add_argument("--sets", type=int, default=4, help="input sets per case (same M:T)")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    cases = [tuple(map(int, c.split(":"))) for c in args.cases.split(",") if c]
    variants = {}
    for spec in args.variant:
        name, _, env = spec.partition(":")
        variants[name] = kb.parse_env(env)

    layer = kb.gpu_layer()
    backend = CudaBackend("cuda", max_tokens=max(m for m, _ in cases))
    state = backend.prepare(layer)
    gen = torch.Generator(device="cuda").manual_seed(3)
    rows = []
    for m, t in cases:
        sets = [case_inputs(m, t, gen) for _ in range(args.sets)]
        base = [kb.graphed(backend, state, m, s) for s in sets]
        t_base = kb.time_calls(lambda s, g=base: g[s].replay(), len(sets), 24, 15) * 1e6
        ref = [g.replay().clone() for g in base]
        row = {"M": m, "local_experts_hit": t, "graph_us": t_base, "variants": {}}
        line = f"M={m} T={t}: default {t_base:.1f} us"
        for name, env in variants.items():
            other = [kb.graphed(backend, state, m, s, env=env) for s in sets]
            same = all(torch.equal(g.replay(), r) for g, r in zip(other, ref, strict=True))
            us, ratio = kb.time_vs(base, other, len(sets), 24, 15)
            row["variants"][name] = {"env": env, "graph_us": us, "ratio": ratio, "same_bits": same}
            line += f" | {name} {us:.1f} ({ratio:.3f}{'' if same else ', bits differ'})"
            del other
        print(line, flush=True)
        rows.append(row)
        del base
    summary = m1_expectation(rows, list(variants))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"decode-cases-{dt.date.today().isoformat()}.json"
    result = {"device": torch.cuda.get_device_name(), "rows": rows, "m1_expected": summary}
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
