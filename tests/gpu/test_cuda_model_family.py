"""The model-family end to end on a GPU: the tiny Qwen3-MoE ModelOpt export served by two
shard processes on the `cuda` backend (the compiled kernels), the frontend's model on the
same GPU calling them over cuda-ipc (chosen by itself), generates the tokens of the same
model running the export's experts decoded locally (tests/family.py). The example runs
as documented with --device cuda. Skipped without CUDA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import serving_shards

from expertd import dataplane as dp
from expertd.client import ExpertClient
from expertd.client.hf import use_remote_experts
from expertd.server.checkpoint import CheckpointReader

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
family = pytest.importorskip("family", reason="needs transformers (the dev extra)")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "remote_experts_hf.py"


@pytest.fixture(scope="module")
def shards():
    with serving_shards("--checkpoint", str(family.FIXTURE), "--device", "cuda") as procs:
        yield procs


def test_remote_experts_on_gpu_shards_generate_the_local_tokens(shards):
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(1, 512, (3, 7), generator=gen).cuda()

    local = family.build_model("cuda")
    family.use_local_dequantized_experts(local, CheckpointReader(family.FIXTURE))
    local.to("cuda")
    want_tokens, want_logits = family.generate(local, prompts)

    remote = family.build_model("cuda")
    with ExpertClient([s.address for s in shards], timeout=30) as client:
        assert sorted(use_remote_experts(remote, client)) == [0, 1]
        got_tokens, got_logits = family.generate(remote, prompts)
        stats = client.stats()
    assert {s["transport"] for s in stats.values()} == {dp.CUDA_IPC}, stats
    assert all(s["calls"] > 0 for s in stats.values()), stats
    family.assert_same_tokens(want_tokens, want_logits, got_tokens, got_logits)


def test_example_runs_on_gpu_shards():
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--device", "cuda", "--new-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens/s" in done.stdout and "cuda-ipc" in done.stdout, done.stdout
    print(done.stdout)
