"""The client's per-call host tensor work (client/core.py): `combine` (the float32 sum of
the shards' bf16 answers, rounded once to bf16) and `forward_request`'s row gather, old
against new, quiet and beside busy processes.

The answers are what the client gets: top-8 of 256 expert ids per token (fixed seed),
shard = expert // 32, a shard's tokens = the tokens with any route to it (~2/3 of them at 8
shards), each answer a parsed ForwardResponse whose output bytes sit where the wire puts them.

`--busy K` starts K processes spinning pure Python loops for the timing: on a machine with
few cores the OS then runs the client's threads late, as beside shard servers. Means are
printed beside medians because waits at an OpenMP barrier show in the mean and the tail.

    python benchmarks/client_combine.py --busy 3 --out /tmp/combine.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import numpy as np
import torch

from expertd import codec, wire
from expertd.client import core
from expertd.client.core import Inputs, Piece
from expertd.client.routing import ShardPart
from expertd.v1 import expertd_pb2 as pb

# ---------------------------------------------------------------------------------------
# BEFORE: client/core.py as it was before the numpy-only combine (copied as the reference).
# Up to NUMPY_MAX_ELEMENTS output elements numpy, above it torch's index_add_ (OpenMP).
NUMPY_MAX_ELEMENTS = 1 << 17


def _bf16_to_f32_before(bits: np.ndarray) -> np.ndarray:
    u = bits.astype(np.uint32)
    np.left_shift(u, 16, out=u)
    return u.view(np.float32)


def _f32_to_bf16_before(a: np.ndarray) -> np.ndarray:
    u = a.view(np.uint32)
    out = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def combine_before(
    inputs: Inputs, hidden_size: int, pieces: list[Piece], bound: int = NUMPY_MAX_ELEMENTS
) -> torch.Tensor:
    m = inputs.x.shape[0]
    parts = []
    for piece in sorted(pieces, key=lambda p: p.shard):
        partial = wire.decode(piece.output, "output")
        if tuple(partial.shape) != (piece.tokens.numel(), hidden_size):
            raise ValueError("shape")
        parts.append((piece.tokens, partial))
    out = torch.empty((m, hidden_size), dtype=torch.bfloat16, pin_memory=inputs.pinned)
    if m * hidden_size <= bound:
        acc = np.zeros((m, hidden_size), dtype=np.float32)
        for tokens, partial in parts:
            f = _bf16_to_f32_before(core._bf16_bits(partial))
            if tokens.numel() == m:
                acc += f
            else:
                acc[tokens.numpy()] += f
        core._bf16_bits(out)[:] = _f32_to_bf16_before(acc)
        return out
    total = torch.zeros((m, hidden_size), dtype=torch.float32)
    for tokens, partial in parts:
        total.index_add_(0, tokens, partial.float())
    return out.copy_(total)


def gather_before(inputs: Inputs, part: ShardPart, bound: int = NUMPY_MAX_ELEMENTS):
    if part.tokens.numel() * inputs.x.shape[1] <= bound:
        rows = core._bf16_bits(inputs.x)[part.tokens.numpy()]
        return torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)
    return inputs.x[part.tokens]


# END BEFORE
# ---------------------------------------------------------------------------------------


def make_call(m: int, hidden: int, shards: int, experts: int, top_k: int, seed: int):
    """-> (inputs, pieces, parts): one call's inputs, the shards' parsed answers, and the
    shard parts the requests gather rows for."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((m, experts)), axis=1)[:, :top_k]
    shard_of = ids // (experts // shards)
    x = torch.from_numpy(rng.standard_normal((m, hidden), dtype=np.float32)).to(torch.bfloat16)
    inputs = Inputs(x, torch.from_numpy(ids.astype(np.int32)), torch.ones(m, top_k), x.device)
    pieces, parts = [], []
    for s in range(shards):
        tokens = np.flatnonzero((shard_of == s).any(axis=1)).astype(np.int64)
        out = torch.from_numpy(rng.standard_normal((tokens.size, hidden), dtype=np.float32) * 3)
        payload = out.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        raw = codec.encode_forward_response(
            int(rng.integers(1, 1 << 40)), pb.BF16, (tokens.size, hidden), payload, None
        )
        t = torch.from_numpy(tokens)
        pieces.append(Piece(s, t, codec.parse_forward_response(raw).output))
        k = torch.zeros((tokens.size, 1), dtype=torch.int32)
        parts.append(ShardPart(s, t, k, torch.ones(tokens.size, 1), [s]))
    return inputs, pieces, parts


def times_ms(fn, repeats: int) -> list[float]:
    fn()  # warm: scratch buffers, lazy imports
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def spin(stop) -> None:
    x = 0
    while not stop.is_set():
        for i in range(10_000):
            x += i


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality, NaN elements compared by NaN-ness (old numpy wrote 0x7FC0, torch 0xFFFF)."""
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False
    return torch.equal(a.view(torch.int16)[~na], b.view(torch.int16)[~nb])


def with_threads(n: int | None, fn, *args):
    """fn(*args) with torch on n threads (this process only; None: as it is), then as it was."""
    if n is None:
        return fn(*args)
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def measure(m: int, args) -> list[dict]:
    h = args.hidden
    inputs, pieces, parts = make_call(m, h, args.shards, args.experts, args.top_k, args.seed + m)
    variants = {  # name: (fn, torch threads for it)
        "combine before": (lambda: combine_before(inputs, h, pieces), None),
        "combine before, numpy": (lambda: combine_before(inputs, h, pieces, 1 << 62), None),
        "combine before, torch 1 thread": (lambda: combine_before(inputs, h, pieces, -1), 1),
        "combine new": (lambda: core.combine(inputs, h, pieces), None),
        "gather before": (lambda: [gather_before(inputs, p) for p in parts], None),
        "gather before, torch 1 thread": (
            lambda: [gather_before(inputs, p, -1) for p in parts],
            1,
        ),
        "gather new": (lambda: [core.forward_request(0, inputs, p) for p in parts], None),
    }
    new = core.combine(inputs, h, pieces)
    ok = same_bits(new, combine_before(inputs, h, pieces, 1 << 62))
    ok &= same_bits(new, with_threads(1, lambda: combine_before(inputs, h, pieces, -1)))
    got = [core.forward_request(0, inputs, p).hidden_states for p in parts]
    want = [gather_before(inputs, p, -1) for p in parts]
    ok &= all(same_bits(a, b) for a, b in zip(got, want, strict=True))
    samples = {name: [] for name in variants}
    for _ in range(args.rounds):  # interleaved, so drift hits every variant alike
        for name, (fn, threads) in variants.items():
            samples[name] += with_threads(threads, times_ms, fn, args.repeats)
    return [
        {
            "m": m,
            "what": name,
            "median_ms": statistics.median(ts),
            "mean_ms": statistics.fmean(ts),
            "p90_ms": float(np.percentile(ts, 90)),
            "n": len(ts),
            "same_bits": ok,
        }
        for name, ts in samples.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per variant")
    ap.add_argument("--busy", type=int, default=0, help="busy-spinning processes beside")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()

    stop = mp.Event()
    spinners = [mp.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    try:
        rows = [r for m in args.m for r in measure(m, args)]
    finally:
        stop.set()
        for p in spinners:
            p.join(5)

    print(
        f"busy processes: {args.busy}, torch threads: {torch.get_num_threads()}, H = {args.hidden}"
    )
    print(f"{'M':>5}  {'what':<32} {'median ms':>10} {'mean ms':>9} {'p90 ms':>9}  same bits")
    for r in rows:
        print(
            f"{r['m']:>5}  {r['what']:<32} {r['median_ms']:>10.3f} {r['mean_ms']:>9.3f}"
            f" {r['p90_ms']:>9.3f}  {r['same_bits']}"
        )
    if args.out:
        meta = {k: v for k, v in vars(args).items() if k != "out"}
        with open(args.out, "w") as f:
            json.dump(
                {"args": meta, "torch_threads": torch.get_num_threads(), "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
