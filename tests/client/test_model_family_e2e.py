"""End to end with a real model family: a transformers Qwen3-MoE whose experts are a ModelOpt
NVFP4 export (tests/fixtures/qwen3-moe-tiny, made by scripts/make_qwen3_moe_fixture.py),
served in two shards by real servers, generates the same tokens greedily as the same model
running the dequantized experts locally (up to a near tie of the logits, where rounding
may decide: tests/family.py, shared with the GPU test).
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
from expertd.client.hf import load_unquantized_weights, moe_blocks, use_remote_experts
from expertd.server.app import BackgroundServer
from expertd.server.checkpoint import CheckpointReader
from expertd.server.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
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


def test_example_runs_as_documented():
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--checkpoint", str(FIXTURE), "--new-tokens", "6"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "MoE layers [0, 1]" in done.stdout and "generated 12 tokens" in done.stdout
