"""The model-family end-to-end check shared by the CPU test (tests/client/
test_model_family_e2e.py) and the GPU one (tests/gpu/test_cuda_model_family.py): the
tiny Qwen3-MoE of tests/fixtures/qwen3-moe-tiny (a ModelOpt NVFP4 export, made by
scripts/make_qwen3_moe_fixture.py) built as a frontend builds it, the same model with
the export's experts decoded and run locally as the reference, greedy generation, and
the comparison of the two.

The local experts are transformers' own Qwen3MoeExperts holding the export's experts
decoded by expertd's NVFP4 codec, evaluated in float32 (as a shard does, its input and
output in bf16): an implementation of the expert math independent of expertd's
reference and kernels.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers  # the dev extra; run pytest from the venv (the checkout's kernels/ folder

# would shadow the `kernels` package transformers imports if the checkout were on sys.path)
from expertd.client.hf import load_unquantized_weights, moe_blocks
from expertd.kernels.reference import relative_error
from expertd.server.checkpoint import CheckpointReader

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "qwen3-moe-tiny"
NEW_TOKENS = 12
TIE = 0.05  # logits closer than this are a near tie (the spread of the logits is ~1.3)


def build_model(device: str = "cpu") -> torch.nn.Module:
    """The fixture's model with its unquantized tensors loaded, in float32 on `device`;
    experts not loaded yet."""
    config = json.loads((FIXTURE / "config.json").read_text())
    config.pop("quantization_config")  # the frontend builds a plain bf16 model
    model_config = transformers.Qwen3MoeConfig(**config)
    torch.manual_seed(0)  # the experts' placeholders; every expert is replaced below
    model = transformers.Qwen3MoeForCausalLM(model_config).float().eval()
    load_unquantized_weights(model, FIXTURE)
    return model.to(device)


class Float32Experts(torch.nn.Module):
    """transformers' experts module in float32 on bf16 activations, as a shard computes."""

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.inner = experts.float()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        x = hidden_states.to(torch.bfloat16).float()  # what travels to a shard
        out = self.inner(x, top_k_index, top_k_weights.float())
        return out.to(torch.bfloat16).to(hidden_states.dtype)  # what comes back


class ZeroExperts(torch.nn.Module):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        return torch.zeros_like(hidden_states)


def use_local_dequantized_experts(model: torch.nn.Module, reader: CheckpointReader) -> None:
    everyone = list(range(reader.num_experts))
    for layer, block in moe_blocks(model).items():
        shard = reader.load_layer(layer, everyone)
        assert shard.norm_weight is None  # a Qwen3-MoE layer has no post-expert norm
        experts = block.experts
        with torch.no_grad():
            experts.gate_up_proj.copy_(
                torch.cat((shard.gate.dequantize(), shard.up.dequantize()), dim=1)
            )
            experts.down_proj.copy_(shard.down.dequantize())
        block.experts = Float32Experts(experts)


def generate(
    model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int = NEW_TOKENS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy continuation of `prompts` and the logits of every generated step."""
    with torch.no_grad():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[:, prompts.shape[1] :], torch.stack(out.logits, dim=1).float()


def assert_same_tokens(want_tokens, want_logits, got_tokens, got_logits) -> None:
    """The same tokens, step by step. The two sides round differently (a shard's bf16
    partials are summed by the client), so logits differ by ~1e-3 of their spread: a
    prompt may part only where the local logits of the two choices are a near tie
    (within TIE), and is compared no further (its contexts differ from there on)."""
    matched = 0
    prompts, steps = want_tokens.shape
    for p in range(prompts):
        for step in range(steps):
            want, got = want_tokens[p, step].item(), got_tokens[p, step].item()
            if want != got:
                logits = want_logits[p, step]
                gap = (logits[want] - logits[got]).item()
                assert gap <= TIE, f"prompt {p} step {step}: {got} for {want}, gap {gap:.3f}"
                break
            err = relative_error(got_logits[p, step].cpu(), want_logits[p, step].cpu())
            assert err < 1e-2, f"prompt {p} step {step}: logits differ by {err:.2e}"
            matched += 1
    assert matched >= 0.8 * want_tokens.numel(), (got_tokens, want_tokens)
