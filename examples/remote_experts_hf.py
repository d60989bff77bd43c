"""Run a transformers MoE model with its experts on expertd shards, from a ModelOpt NVFP4 export.

    python examples/remote_experts_hf.py                       # the tiny Qwen3-MoE test fixture
    python examples/remote_experts_hf.py --device cuda         # model and shards on the GPU
    python examples/remote_experts_hf.py --checkpoint DIR --servers host:50051,host:50052
    python examples/remote_experts_hf.py --device cuda --local-baseline   # tokens/s both ways

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

`--local-baseline` also runs that local model (the export's experts decoded to bf16 into
transformers' own experts module, on `--device`) on the same prompts and prints its
tokens/s beside the remote one's, and whether the tokens agree.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import transformers

from expertd import cudamem
from expertd.client import ExpertClient
from expertd.client.hf import load_unquantized_weights, moe_blocks, use_remote_experts

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen3-moe-tiny"


def build_model(checkpoint: Path) -> torch.nn.Module:
    """Step 1: the model from config.json, its unquantized tensors from the export."""
    config = json.loads((checkpoint / "config.json").read_text())
    config.pop("quantization_config", None)  # a plain bf16 model; the experts go remote
    model_config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    model = transformers.AutoModelForCausalLM.from_config(model_config, dtype=torch.bfloat16)
    load_unquantized_weights(model.eval(), checkpoint)
    return model


def use_local_experts(model: torch.nn.Module, checkpoint: Path) -> None:
    """The baseline: every MoE block's experts decoded from the export into transformers'
    own experts module, in the model's dtype: fused `gate_up_proj` [E, 2I, H] and
    `down_proj` [E, H, I] as Qwen3-MoE, Mixtral and DeepSeek-V3 hold them, transposed
    ([E, H, 2I], [E, I, H]) in Llama-4's."""
    from expertd.server.checkpoint import CheckpointReader  # the shard's decoder, reused

    reader = CheckpointReader(checkpoint)
    everyone = list(range(reader.num_experts))
    for layer, block in moe_blocks(model).items():
        experts = block.experts
        if not hasattr(experts, "gate_up_proj") or reader.post_norm:
            raise SystemExit(f"--local-baseline: no local baseline for {type(experts).__name__}")
        shard = reader.load_layer(layer, everyone)
        gate_up = torch.cat((shard.gate.dequantize(), shard.up.dequantize()), dim=1)
        down = shard.down.dequantize()
        if type(experts).__name__ == "Llama4TextExperts":
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        with torch.no_grad():
            experts.gate_up_proj.copy_(gate_up)
            experts.down_proj.copy_(down)


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
    parser.add_argument(
        "--local-baseline", action="store_true", help="also time the model's experts run locally"
    )
    args = parser.parse_args(argv)
    prompts = torch.randint(1, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    prompts = prompts.to(args.device)

    shards, threads = [], torch.get_num_threads()
    if args.servers:
        addresses = args.servers.split(",")
    else:
        from expertd.launcher import start_shard, stop_shards, wait_serving

        serve = ["--checkpoint", str(args.checkpoint), "--device", args.device]
        if args.device == "cpu":
            # The model and both shards share this host's cores. torch's workers spin for
            # a while after each parallel op, so three processes each sized for every core
            # take turns on them: with one core's share each a layer call on two cores
            # takes a few ms instead of 10-25 ms (docs/models.md).
            cores = os.cpu_count() or 1
            serve += ["--torch-threads", str(max(1, cores // 3))]
            torch.set_num_threads(max(1, cores - 2 * max(1, cores // 3)))
        for shard in range(2):
            shards.append(start_shard([*serve, "--shard", str(shard), "--num-shards", "2"]))
        wait_serving(shards, timeout=600)
        addresses = [s.address for s in shards]
    try:
        model = build_model(args.checkpoint).to(args.device)
        with ExpertClient(addresses, timeout=60) as client:
            layers = use_remote_experts(model, client)  # step 2: the swap
            # A first generation of the same length: connections, data plane leases and,
            # on a GPU, the attention kernels' setup for each new sequence length, which
            # costs tens of ms apiece the first time (docs/models.md)
            greedy(model, prompts, args.new_tokens)
            start = time.perf_counter()
            tokens = greedy(model, prompts, args.new_tokens)  # step 3
            seconds = time.perf_counter() - start
            stats = client.stats().values()
        print(f"remote experts on {len(addresses)} shards, MoE layers {sorted(layers)}")
        print(f"generated {tokens.numel()} tokens in {seconds:.2f} s: {tokens.tolist()}")
        print(f"{tokens.numel() / seconds:.1f} tokens/s ({prompts.shape[0]} sequences)")
        print(f"calls per shard: {[s['calls'] for s in stats]}")
        print(f"data plane per shard: {[s['transport'] for s in stats]}")
        if args.device == "cuda" and not args.servers and cudamem.mps_control_pipe() is None:
            print(
                "no MPS daemon: the model and the shards time-slice the GPU, which slows "
                'each layer call (docs/operations.md, "Several processes on one GPU: MPS")'
            )
    finally:
        if shards:
            stop_shards(shards)
            torch.set_num_threads(threads)  # the local baseline has the cores to itself
    if args.local_baseline:
        local = build_model(args.checkpoint)
        use_local_experts(local, args.checkpoint)
        local.to(args.device)
        greedy(local, prompts, args.new_tokens)  # the same first generation
        start = time.perf_counter()
        want = greedy(local, prompts, args.new_tokens)
        local_seconds = time.perf_counter() - start
        same = (want == tokens).float().mean().item()
        print(
            f"local experts: {want.numel() / local_seconds:.1f} tokens/s; remote / local time "
            f"{seconds / local_seconds:.2f}x; {same:.0%} of the tokens equal"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
