"""An example frontend: discover the shards, call every layer once, print the timing.

    EXPERTD_ADDRESSES=shard-0:50051,shard-1:50051 python example_client.py [--tokens 64]

It routes random tokens the way a router does (top_k distinct experts per token,
softmax weights), so every shard gets work; it exits 1 if an output is not finite.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from expertd.client import ExpertClient


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("addresses", nargs="*", help="default: EXPERTD_ADDRESSES, comma separated")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=30.0)
    args = p.parse_args()
    addresses = args.addresses or os.environ.get("EXPERTD_ADDRESSES", "").split(",")
    addresses = [a.strip() for a in addresses if a.strip()]
    if not addresses:
        p.error("no addresses: pass them or set EXPERTD_ADDRESSES")
    gen = torch.Generator().manual_seed(0)
    with ExpertClient(addresses, timeout=args.timeout) as client:
        topo = client.topology
        layers = sorted(set().union(*(s.layers for s in topo.shards)))
        print(
            f"{len(addresses)} addresses: H={topo.hidden_size} E={topo.num_experts} "
            f"top_k={topo.top_k}, layers {layers[0]}..{layers[-1]}"
        )
        for layer in layers:
            x = torch.randn((args.tokens, topo.hidden_size), generator=gen).to(torch.bfloat16)
            logits = torch.randn((args.tokens, topo.num_experts), generator=gen)
            top = logits.topk(topo.top_k, dim=1)
            start = time.perf_counter()
            out = client.forward(layer, x, top.indices.int(), torch.softmax(top.values, dim=1))
            ms = (time.perf_counter() - start) * 1e3
            finite = bool(torch.isfinite(out.float()).all())
            print(f"layer {layer}: {args.tokens} tokens in {ms:.1f} ms, finite={finite}")
            if not finite:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
