"""Make tests/fixtures/qwen3-moe-tiny: a tiny Qwen3-MoE, quantized to NVFP4 and exported by
NVIDIA ModelOpt, the checkpoint the end-to-end test serves (tests/client/test_families_e2e.py).

The model is a transformers Qwen3-MoE with seeded random weights (2 layers, H = I = 256,
8 experts, top-2, a 512-token vocabulary), built in bf16. ModelOpt quantizes only the
routed experts (NVFP4_EXPERTS_ONLY_CFG: NVFP4 weights and inputs, the input scales from a
calibration pass over seeded random tokens) and `export_hf_checkpoint` writes them as a
ModelOpt NVFP4 export: per-expert uint8 weights, fp8 block scales, fp32 global and input
scales, `hf_quant_config.json`; attention, router, norms and embeddings stay bf16. The
export is committed (about 2 MB), so CI needs neither ModelOpt nor this script. Beside it,
`qwen3-moe-tiny-bf16-rows.safetensors` keeps the first 16 rows of some experts' bf16 weights
before quantization, so a test can check expertd's decoding against the model itself.

Made on a CPU-only machine (Python 3.11) with exactly:

    torch==2.13.0 (CPU)  transformers==5.25.0  nvidia-modelopt==0.47.0  safetensors==0.8.0

    python3 -m venv /tmp/mo && /tmp/mo/bin/pip install torch==2.13.0 \\
        transformers==5.25.0 nvidia-modelopt==0.47.0 requests safetensors
    cd /tmp && /tmp/mo/bin/python /path/to/expertd/scripts/make_qwen3_moe_fixture.py \
        /path/to/expertd/tests/fixtures/qwen3-moe-tiny

Run it from outside the checkout: transformers imports a package named `kernels` when the
Hugging Face kernels library is installed (ModelOpt pulls it in), and the checkout's own
`kernels/` folder would shadow it. ModelOpt 0.47 imports `requests` without declaring it.
Two workarounds for its export on this stack: the model is built with `dtype=torch.bfloat16`
(a string dtype in the config breaks the export) and `config.architectures` is set.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from modelopt_export import E2M1, quantize_and_export
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

SEED = 0
ROWS = 16  # rows kept per projection in the bf16 reference file
KEPT = ((0, 0), (0, 5), (1, 7))  # (layer, expert) whose rows are kept
CONFIG = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=256,
    moe_intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    # Larger than the 0.02 default, so the experts' share of each layer's output is large
    # enough for their quantization to matter to the next token.
    initializer_range=0.08,
    architectures=["Qwen3MoeForCausalLM"],
)


def build_model() -> Qwen3MoeForCausalLM:
    torch.manual_seed(SEED)
    config = Qwen3MoeConfig(**CONFIG)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    model.config.architectures = ["Qwen3MoeForCausalLM"]
    model.config.dtype = torch.bfloat16
    return model


def dequantize(f, name: str) -> torch.Tensor:
    """One exported projection back to float32: low nibble = even column, bit 3 the sign."""
    packed = f.get_tensor(f"{name}.weight")
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()
    scales = f.get_tensor(f"{name}.weight_scale").float().repeat_interleave(16, dim=-1)
    return E2M1[codes] * scales * f.get_tensor(f"{name}.weight_scale_2").float()


def check_export(path: Path, experts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every exported expert is its bf16 weights within NVFP4's rounding (gate, up, down in
    their places), so the fixture is the model it claims to be."""
    from safetensors import safe_open

    inter = CONFIG["moe_intermediate_size"]
    worst = 0.0
    with safe_open(path, framework="pt") as f:
        for layer, (gate_up, down) in enumerate(experts):
            for e in range(CONFIG["num_experts"]):
                base = f"model.layers.{layer}.mlp.experts.{e}"
                for proj, want in (
                    ("gate_proj", gate_up[e, :inter]),
                    ("up_proj", gate_up[e, inter:]),
                    ("down_proj", down[e]),
                ):
                    got = dequantize(f, f"{base}.{proj}")
                    err = ((got - want.float()).norm() / want.float().norm()).item()
                    worst = max(worst, err)
    print(
        f"export check: worst relative error of a projection against its bf16 weights {worst:.3f}"
    )
    if worst > 0.15:
        raise SystemExit("the export does not decode to the model's expert weights")


def save_rows(path: Path, experts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The first ROWS rows of KEPT experts' gate, up and down weights, bf16, by export name."""
    from safetensors.torch import save_file

    inter = CONFIG["moe_intermediate_size"]
    rows = {}
    for layer, e in KEPT:
        gate_up, down = experts[layer]
        base = f"model.layers.{layer}.mlp.experts.{e}"
        rows[f"{base}.gate_proj.weight"] = gate_up[e, :ROWS].contiguous()
        rows[f"{base}.up_proj.weight"] = gate_up[e, inter : inter + ROWS].contiguous()
        rows[f"{base}.down_proj.weight"] = down[e, :ROWS].contiguous()
    save_file(rows, path, metadata={"rows": str(ROWS)})
    path.chmod(0o644)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    start = time.perf_counter()
    model = build_model()
    experts = [
        (
            layer.mlp.experts.gate_up_proj.detach().clone(),
            layer.mlp.experts.down_proj.detach().clone(),
        )
        for layer in model.model.layers
    ]
    quantize_and_export(model, CONFIG["vocab_size"], SEED + 1, args.out)
    check_export(args.out / "model.safetensors", experts)
    save_rows(args.out.with_name(args.out.name + "-bf16-rows.safetensors"), experts)
    config = json.loads((args.out / "config.json").read_text())
    sizes = {p.name: p.stat().st_size for p in sorted(args.out.iterdir())}
    print(json.dumps({"seconds": round(time.perf_counter() - start, 1), "files": sizes}))
    print("quantization_config:", json.dumps(config.get("quantization_config"))[:300])


if __name__ == "__main__":
    main()
