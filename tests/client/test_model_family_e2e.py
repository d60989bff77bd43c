"""End to end with a real model family: a transformers Qwen3-MoE whose experts are a ModelOpt
NVFP4 export (tests/fixtures/qwen3-moe-tiny, made by scripts/make_qwen3_moe_fixture.py),
served in two shards by real servers, generates the same tokens greedily as the same model
running the dequantized experts locally (up to a near tie of the logits, where rounding
may decide; see the test).

The local experts are transformers' own Qwen3MoeExperts holding the export's experts decoded
by expertd's NVFP4 codec, evaluated in float32 (as a shard does, its input and output in
bf16): an implementation of the expert math independent of expertd's reference.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers  # the dev extra; run pytest from the venv (the checkout's kernels/ folder

# would shadow the `kernels` package transformers imports if the checkout were on sys.path)
from safetensors.torch import load_file, save_file

from expertd.client import ExpertClient, RemoteExperts
from expertd.client.hf import load_unquantized_weights, moe_blocks, use_remote_experts
from expertd.kernels.reference import relative_error
from expertd.server.app import BackgroundServer
from expertd.server.checkpoint import CheckpointReader
from expertd.server.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "qwen3-moe-tiny"
EXAMPLE = ROOT / "examples" / "remote_experts_hf.py"
NEW_TOKENS = 12
TIE = 0.05  # logits closer than this are a near tie (the spread of the logits is ~1.3)


def build_model() -> torch.nn.Module:
    """The fixture's model with its unquantized tensors loaded; experts not loaded yet."""
    config = json.loads((FIXTURE / "config.json").read_text())
    config.pop("quantization_config")  # the frontend builds a plain bf16 model
    model_config = transformers.Qwen3MoeConfig(**config)
    torch.manual_seed(0)  # the experts' placeholders; every expert is replaced below
    model = transformers.Qwen3MoeForCausalLM(model_config).float().eval()
    load_unquantized_weights(model, FIXTURE)
    return model


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


def generate(model: torch.nn.Module, prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy continuation of `prompts` and the logits of every generated step."""
    with torch.no_grad():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[:, prompts.shape[1] :], torch.stack(out.logits, dim=1).float()


@pytest.fixture(scope="module")
def shards():
    servers = [
        BackgroundServer(ServerConfig(checkpoint=str(FIXTURE), shard=s, num_shards=2, device="cpu"))
        for s in range(2)
    ]
    yield servers
    for server in servers:
        server.stop()


def test_reader_takes_the_modelopt_export_as_it_is():
    reader = CheckpointReader(FIXTURE)
    cfg = reader.expert_config
    assert (reader.hidden_size, reader.intermediate_size, reader.num_experts) == (256, 256, 8)
    assert reader.layers == [0, 1] and reader.top_k == 2 and not reader.post_norm
    assert (cfg.family, cfg.quant_algo, cfg.norm_topk_prob) == ("qwen3-moe", "NVFP4", True)
    assert "model.layers.0.self_attn*" in cfg.exclude_modules
    quant = json.loads((FIXTURE / "hf_quant_config.json").read_text())
    assert quant["producer"] == {"name": "modelopt", "version": "0.47.0"}


def test_remote_experts_generate_the_tokens_of_local_dequantized_experts(shards):
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(1, 512, (3, 7), generator=gen)
    reader = CheckpointReader(FIXTURE)

    local = build_model()
    use_local_dequantized_experts(local, reader)
    want_tokens, want_logits = generate(local, prompts)

    remote = build_model()
    with ExpertClient([s.address for s in shards], timeout=30) as client:
        swapped = use_remote_experts(remote, client)
        assert sorted(swapped) == [0, 1]
        assert all(isinstance(b.experts, RemoteExperts) for b in moe_blocks(remote).values())
        got_tokens, got_logits = generate(remote, prompts)
        calls = {address: s["calls"] for address, s in client.stats().items()}
    assert all(n > 0 for n in calls.values()), calls  # both shards took part

    # The same tokens, step by step. The two sides round differently (a shard's bf16
    # partials are summed by the client), so logits differ by ~1e-3 of their spread: a
    # prompt may part only where the local logits of the two choices are a near tie
    # (within TIE), and is compared no further (its contexts differ from there on).
    matched = 0
    for p in range(prompts.shape[0]):
        for step in range(NEW_TOKENS):
            want, got = want_tokens[p, step].item(), got_tokens[p, step].item()
            if want != got:
                logits = want_logits[p, step]
                gap = (logits[want] - logits[got]).item()
                assert gap <= TIE, f"prompt {p} step {step}: {got} for {want}, gap {gap:.3f}"
                break
            err = relative_error(got_logits[p, step], want_logits[p, step])
            assert err < 1e-2, f"prompt {p} step {step}: logits differ by {err:.2e}"
            matched += 1
    assert matched >= 0.8 * want_tokens.numel(), (got_tokens, want_tokens)

    # The experts decide the tokens: without them the same model says something else.
    silent = build_model()
    for block in moe_blocks(silent).values():
        block.experts = ZeroExperts()
    silent_tokens, _ = generate(silent, prompts)
    assert (silent_tokens != want_tokens).float().mean() > 0.5


def test_frontend_refuses_a_checkpoint_missing_a_tensor(tmp_path):
    tensors = load_file(FIXTURE / "model.safetensors")
    del tensors["model.layers.1.self_attn.q_norm.weight"]
    tensors["model.norm.weight"] = torch.zeros(128, dtype=torch.bfloat16)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \[128\], .* \[256\]"):
        load_unquantized_weights(build_model(), tmp_path)
    tensors["model.norm.weight"] = torch.zeros(256, dtype=torch.bfloat16)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.q_norm\.weight"):
        load_unquantized_weights(build_model(), tmp_path)


def test_serve_refuses_an_unsupported_setting_naming_it(tmp_path):
    """`expertd serve` on the export with its activation changed stops at load, the file
    and field named."""
    bad = tmp_path / "gelu"
    shutil.copytree(FIXTURE, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    done = subprocess.run(
        [sys.executable, "-m", "expertd", "serve", "--checkpoint", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "hidden_act = 'gelu' is not supported" in done.stderr, done.stderr[-2000:]


def test_example_runs_as_documented():
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--checkpoint", str(FIXTURE), "--new-tokens", "6"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "MoE layers [0, 1]" in done.stdout and "generated 12 tokens" in done.stdout
