"""A tiny MoE model whose expert layers run on remote expertd shards.

Each block is router -> top-k -> experts, with a residual (attention-free, to
stay tiny). The experts of every block are swapped, in one line, for
`RemoteExperts(client, layer)`, served by three local shard servers that show
the placements the client handles:

    a, a'  experts 0-39     two replicas of the same placement
    b      experts 24-63    24-39 are redundant with a (each route goes to one owner)

The remote model must match the same model run locally on the reference
(`expertd.kernels.reference_forward` over each full layer). Then replica `a` is
stopped and the model runs again: the calls fail over to `a'` and `b`.

    python examples/tiny_moe.py          # CPU, a few seconds
"""

from __future__ import annotations

import argparse
import time

import torch

from expertd.client import ExpertClient, RemoteExperts
from expertd.kernels import reference_forward, relative_error
from expertd.server.app import BackgroundServer
from expertd.server.bank import ExpertBank
from expertd.server.config import ServerConfig
from expertd.server.synthetic import get_preset, synthetic_layer

PLACEMENTS = {"a": list(range(0, 40)), "a'": list(range(0, 40)), "b": list(range(24, 64))}


class LocalExperts(torch.nn.Module):
    """The layer's experts in this process: the reference on the full layer."""

    def __init__(self, layer) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, topk_ids, topk_weights):  # [..., H], [..., K], [..., K]
        h, k = hidden_states.shape[-1], topk_ids.shape[-1]
        x = hidden_states.reshape(-1, h).to(torch.bfloat16)
        out = reference_forward(self.layer, x, topk_ids.reshape(-1, k), topk_weights.reshape(-1, k))
        return out.reshape(hidden_states.shape).to(hidden_states.dtype)


class MoEBlock(torch.nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, experts) -> None:
        super().__init__()
        self.router = torch.nn.Linear(hidden, num_experts, bias=False)
        self.top_k = top_k
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, H] float32
        top = self.router(x).topk(self.top_k, dim=-1)
        weights = torch.softmax(top.values, dim=-1)
        return x + self.experts(x, top.indices.to(torch.int32), weights)


class TinyMoE(torch.nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, experts: list) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(MoEBlock(hidden, num_experts, top_k, e) for e in experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8, help="batch 2 x this many tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    preset = get_preset("small")
    torch.manual_seed(args.seed)
    full = [synthetic_layer(preset, args.seed, i, list(range(preset.num_experts))) for i in range(args.layers)]  # fmt: skip
    model = TinyMoE(
        preset.hidden_size, preset.num_experts, preset.top_k, [LocalExperts(f) for f in full]
    )
    x = torch.randn(2, args.tokens, preset.hidden_size)
    with torch.no_grad():
        want = model(x)

    servers, banks = {}, {}
    for name, experts in PLACEMENTS.items():
        config = ServerConfig(
            synthetic="small", layers=args.layers, seed=args.seed, experts=experts
        )
        key = tuple(experts)  # replicas share one loaded bank
        banks.setdefault(key, ExpertBank.load(config, progress=lambda _msg: None))
        servers[name] = BackgroundServer(config, bank=banks[key])
    worst = 0.0
    try:
        with ExpertClient([s.address for s in servers.values()], timeout=10) as client:
            for i, block in enumerate(model.blocks):
                block.experts = RemoteExperts(client, layer=i)  # the one-line swap
            with torch.no_grad():
                got = model(x)
                servers["a"].stop()  # a replica goes away: a' and b take its calls
                again = model(x)
            for label, out in (("all shards up", got), ("replica a stopped", again)):
                err = relative_error(out, want)
                worst = max(worst, err)
                print(f"{label:>18}: output {tuple(out.shape)}, rel. error vs local {err:.2e}")
            for address, s in client.stats().items():
                state = "up" if s["alive"] else "down"
                print(f"  {address}: {state:4} {s['calls']:3d} calls")
    finally:
        for server in servers.values():
            server.stop()
    ok = worst <= 1e-2
    print(f"{'ok' if ok else 'FAILED'}: tolerance 1e-2, {time.monotonic() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
