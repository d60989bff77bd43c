"""Run a transformers MoE model with its experts on expertd shards, from a ModelOpt NVFP4 export.

    python examples/remote_experts_hf.py                       # the tiny Qwen3-MoE test fixture
    python examples/remote_experts_hf.py --device cuda         # model and shards on the GPU
    python examples/remote_experts_hf.py --checkpoint DIR --servers host:50051,host:50052

The steps a frontend takes (copy them):

1. build the model from the export's config.json (transformers cannot load the NVFP4
   export itself) and load its unquantized tensors: attention, router, norms, embeddings;
2. swap every MoE block's experts for `RemoteExperts` on an `ExpertClient`;
3. generate as usual: each MoE layer's experts run on the shards, the rest locally.

Without `--servers` it starts two shard server processes of the checkpoint on `--device`,
as an operator would (`expertd serve --checkpoint DIR --shard S --num-shards 2`). The
model runs on `--device` too; the client picks each shard's data plane by itself
(cuda-ipc for a model on the GPU next to GPU shards, shared memory on the CPU).
tests/client/test_model_family_e2e.py and tests/gpu/test_cuda_model_family.py check that
the tokens are those of the same model running the export's experts decoded locally.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

from expertd.client import ExpertClient
from expertd.client.hf import load_unquantized_weights, use_remote_experts

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen3-moe-tiny"


def build_model(checkpoint: Path) -> torch.nn.Module:
    """Step 1: the model from config.json, its unquantized tensors from the export."""
    config = json.loads((checkpoint / "config.json").read_text())
    config.pop("quantization_config", None)  # a plain bf16 model; the experts go remote
    model_config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    model = transformers.AutoModelForCausalLM.from_config(model_config, dtype=torch.bfloat16)
    load_unquantized_weights(model.eval(), checkpoint)
    return model


def greedy(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, prompts.shape[1] :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=FIXTURE)
    parser.add_argument("--servers", help="shard addresses, comma-separated (default: start 2)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    prompts = torch.randint(1, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    prompts = prompts.to(args.device)

    shards = []
    if args.servers:
        addresses = args.servers.split(",")
    else:
        from expertd.launcher import start_shard, stop_shards, wait_serving

        for shard in range(2):
            serve = ["--checkpoint", str(args.checkpoint), "--device", args.device]
            shards.append(start_shard([*serve, "--shard", str(shard), "--num-shards", "2"]))
        wait_serving(shards, timeout=600)
        addresses = [s.address for s in shards]
    try:
        model = build_model(args.checkpoint).to(args.device)
        with ExpertClient(addresses, timeout=60) as client:
            layers = use_remote_experts(model, client)  # step 2: the swap
            greedy(model, prompts, 2)  # first calls: connections, data plane leases
            start = time.perf_counter()
            tokens = greedy(model, prompts, args.new_tokens)  # step 3
            seconds = time.perf_counter() - start
            stats = client.stats().values()
        print(f"remote experts on {len(addresses)} shards, MoE layers {sorted(layers)}")
        print(f"generated {tokens.numel()} tokens in {seconds:.2f} s: {tokens.tolist()}")
        print(f"{tokens.numel() / seconds:.1f} tokens/s ({prompts.shape[0]} sequences)")
        print(f"calls per shard: {[s['calls'] for s in stats]}")
        print(f"data plane per shard: {[s['transport'] for s in stats]}")
    finally:
        if shards:
            stop_shards(shards)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
