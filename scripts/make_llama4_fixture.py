"""Make tests/fixtures/llama4-tiny: a tiny Llama-4 text model, quantized to NVFP4 and exported
by NVIDIA ModelOpt, the checkpoint of Llama-4's fused expert layout (server/families.py).

The model is a transformers Llama4ForCausalLM with seeded random weights (1 layer, H = I =
256, 4 experts, top-1, a 256-token vocabulary), built in bf16. ModelOpt quantizes only the
routed experts (NVFP4_EXPERTS_ONLY_CFG) and `export_hf_checkpoint` writes them the way it
writes every Llama-4: one tensor per layer for all experts' gate and up and one for down,
packed along the input dimension, `_`-joined suffixes for the scales:

    feed_forward.experts.gate_up_proj                  uint8 [E, H/2, 2I] (gate: the first I columns)
    feed_forward.experts.gate_up_proj_weight_scale     float8_e4m3fn [E, H/16, 2I]
    feed_forward.experts.gate_up_proj_weight_scale_2   fp32 scalar, one per layer
    feed_forward.experts.down_proj                     uint8 [E, I/2, H], and its scales

(a byte holds the weights of inputs 2j, low nibble, and 2j + 1, high nibble). The export is
committed (about 1 MB), so CI needs neither ModelOpt nor this script. Beside it,
`llama4-tiny-bf16-rows.safetensors` keeps the first 16 input rows of every expert's bf16
gate_up and down before quantization, so a test can check expertd's reading against the
model itself.

Made on a CPU-only machine (Python 3.11) with the versions and the venv of
scripts/make_qwen3_moe_fixture.py (torch 2.13.0 CPU, transformers 5.25.0, nvidia-modelopt
0.47.0), run from outside the checkout for the reason given there:

    cd /tmp && /tmp/mo/bin/python /path/to/expertd/scripts/make_llama4_fixture.py \\
        /path/to/expertd/tests/fixtures/llama4-tiny
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from modelopt_export import E2M1, quantize_and_export
from transformers import Llama4ForCausalLM, Llama4TextConfig

SEED = 0
ROWS = 16  # input rows kept per expert and projection in the bf16 reference file
CONFIG = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=256,
    intermediate_size_mlp=512,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=1,
    attention_chunk_size=256,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    initializer_range=0.08,
)


def build_model() -> Llama4ForCausalLM:
    torch.manual_seed(SEED)
    config = Llama4TextConfig(**CONFIG)
    config.architectures = ["Llama4ForCausalLM"]
    model = Llama4ForCausalLM(config).to(torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16
    return model


def dequantize(f, name: str) -> torch.Tensor:
    """One fused projection back to float32 [E, in, out]: inputs 2j (low nibble), 2j + 1."""
    packed = f.get_tensor(name)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-2).flatten(1, 2).long()
    scales = f.get_tensor(f"{name}_weight_scale").float().repeat_interleave(16, dim=1)
    return E2M1[codes] * scales * f.get_tensor(f"{name}_weight_scale_2").float()


def check_export(path: Path, experts: list[dict[str, torch.Tensor]]) -> None:
    """Every exported projection is its bf16 weights within NVFP4's rounding."""
    from safetensors import safe_open

    worst = 0.0
    with safe_open(path, framework="pt") as f:
        for layer, weights in enumerate(experts):
            for proj, want in weights.items():
                got = dequantize(f, f"model.layers.{layer}.feed_forward.experts.{proj}")
                err = ((got - want.float()).norm() / want.float().norm()).item()
                worst = max(worst, err)
    print(f"export check: worst relative error against the bf16 weights {worst:.3f}")
    if worst > 0.15:
        raise SystemExit("the export does not decode to the model's expert weights")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    start = time.perf_counter()
    model = build_model()
    experts = [
        {
            "gate_up_proj": layer.feed_forward.experts.gate_up_proj.detach().clone(),
            "down_proj": layer.feed_forward.experts.down_proj.detach().clone(),
        }
        for layer in model.model.layers
    ]
    quantize_and_export(model, CONFIG["vocab_size"], SEED + 1, args.out)
    check_export(args.out / "model.safetensors", experts)
    from safetensors.torch import save_file

    rows = {
        f"model.layers.{layer}.feed_forward.experts.{proj}": w[:, :ROWS].contiguous()
        for layer, weights in enumerate(experts)
        for proj, w in weights.items()
    }
    rows_path = args.out.with_name(args.out.name + "-bf16-rows.safetensors")
    save_file(rows, rows_path, metadata={"rows": str(ROWS)})
    rows_path.chmod(0o644)
    sizes = {p.name: p.stat().st_size for p in sorted(args.out.iterdir())}
    print(json.dumps({"seconds": round(time.perf_counter() - start, 1), "files": sizes}))


if __name__ == "__main__":
    main()
