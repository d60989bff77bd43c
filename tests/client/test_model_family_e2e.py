"""End to end with real model families: a transformers Qwen3-MoE whose experts are a ModelOpt
NVFP4 export (tests/fixtures/qwen3-moe-tiny, made by scripts/make_qwen3_moe_fixture.py),
served in two shards by real servers, generates the same tokens greedily as the same model
running the dequantized experts locally (up to a near tie of the logits, where rounding
may decide: tests/family.py, shared with the GPU test); the same for a Llama-4 whose
experts are ModelOpt's fused export (tests/fixtures/llama4-tiny).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from family import (
    FIXTURE,
    ZeroExperts,
    assert_same_tokens,
    build_model,
    generate,
    use_local_dequantized_experts,
)
from safetensors.torch import load_file, save_file

from expertd.client import ExpertClient, RemoteExperts
from expertd.client.hf import (
    RemoteScaledExperts,
    load_unquantized_weights,
    moe_blocks,
    use_remote_experts,
)
from expertd.server.app import BackgroundServer
from expertd.server.checkpoint import CheckpointReader
from expertd.server.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
LLAMA4 = ROOT / "tests" / "fixtures" / "llama4-tiny"
EXAMPLE = ROOT / "examples" / "remote_experts_hf.py"


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

    assert_same_tokens(want_tokens, want_logits, got_tokens, got_logits)

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


@pytest.mark.parametrize(("checkpoint", "layers"), [(FIXTURE, "[0, 1]"), (LLAMA4, "[0]")])
def test_example_runs_as_documented(checkpoint, layers):
    flags = ["--checkpoint", str(checkpoint), "--new-tokens", "6", "--local-baseline"]
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"MoE layers {layers}" in done.stdout and "generated 12 tokens" in done.stdout
    # the local experts decoded into transformers' module (Llama-4's transposed) agree
    assert "local experts:" in done.stdout and "100% of the tokens equal" in done.stdout


def build_llama4() -> torch.nn.Module:
    """The Llama-4 fixture's model, float32, its unquantized tensors loaded."""
    import transformers

    config = json.loads((LLAMA4 / "config.json").read_text())
    config.pop("quantization_config")
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**config))
    model = model.float().eval()
    load_unquantized_weights(model, LLAMA4)
    return model


class Float32ScaledExperts(torch.nn.Module):
    """transformers' Llama4TextExperts in float32 on bf16 activations, as a shard computes."""

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.inner = experts.float()

    def forward(self, routed_in):
        out = self.inner(routed_in.to(torch.bfloat16).float())
        return out.to(torch.bfloat16).to(routed_in.dtype)


def test_llama4_fused_experts_served_generate_the_tokens_of_local_ones():
    """Llama-4 scales a token by its router score before its one expert: the frontend
    module sends the scaled token with weight 1, two shards serve the fused export, and
    greedy generation gives the tokens of transformers' own experts module holding the
    export's experts decoded."""
    reader = CheckpointReader(LLAMA4)
    local = build_llama4()
    for layer, block in moe_blocks(local).items():
        shard = reader.load_layer(layer, list(range(reader.num_experts)))
        experts = block.experts
        with torch.no_grad():  # transformers keeps them [E, in, out]
            experts.gate_up_proj.copy_(
                torch.cat((shard.gate.dequantize(), shard.up.dequantize()), dim=1).transpose(1, 2)
            )
            experts.down_proj.copy_(shard.down.dequantize().transpose(1, 2))
        block.experts = Float32ScaledExperts(experts)
    gen = torch.Generator().manual_seed(4)
    prompts = torch.randint(1, 256, (3, 7), generator=gen)
    want_tokens, want_logits = generate(local, prompts)

    servers = [
        BackgroundServer(ServerConfig(checkpoint=str(LLAMA4), shard=s, num_shards=2, device="cpu"))
        for s in range(2)
    ]
    try:
        remote = build_llama4()
        with ExpertClient([s.address for s in servers], timeout=30) as client:
            swapped = use_remote_experts(remote, client)
            assert sorted(swapped) == [0]
            assert isinstance(moe_blocks(remote)[0].experts, RemoteScaledExperts)
            got_tokens, got_logits = generate(remote, prompts)
            calls = {address: s["calls"] for address, s in client.stats().items()}
    finally:
        for server in servers:
            server.stop()
    assert all(n > 0 for n in calls.values()), calls
    assert_same_tokens(want_tokens, want_logits, got_tokens, got_logits)

    silent = build_llama4()
    for block in moe_blocks(silent).values():
        block.experts = Float32ScaledExperts(block.experts)
        with torch.no_grad():
            block.experts.inner.gate_up_proj.zero_()
    silent_tokens, _ = generate(silent, prompts)
    assert (silent_tokens != want_tokens).float().mean() > 0.3
