"""A Hugging Face transformers MoE model as an expertd frontend (docs/models.md).

    model = Qwen3MoeForCausalLM(config)                 # built from the checkpoint's config
    load_unquantized_weights(model, checkpoint_dir)     # attention, router, norms, embeddings
    use_remote_experts(model, client)                   # every MoE block's experts -> shards
    model.generate(...)

transformers cannot load a ModelOpt NVFP4 export back, and the frontend needs none of its
experts: `load_unquantized_weights` reads every other tensor of the export into the model
(the bf16 ones ModelOpt left unquantized) and refuses a missing one. `use_remote_experts`
swaps each MoE block's `experts` module, which transformers 5 calls as
`experts(hidden_states, top_k_index, top_k_weights)`, for `RemoteExperts(client, L)`; the
router (with its `norm_topk_prob` and scaling), shared experts and dense layers stay local.

Neither function imports transformers: they work on any torch module laid out the
Hugging Face way (`...layers.<L>.<block>.experts`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from expertd.client.module import RemoteExperts
from expertd.client.sync import ExpertClient

# A decoder layer's MoE block: Qwen2/3-MoE and DeepSeek `mlp`, Mixtral `block_sparse_moe`,
# Llama-4 `feed_forward`.
_MOE_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward)$")


def moe_blocks(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Each decoder layer's MoE block that holds an `experts` module, by layer index."""
    blocks = {}
    for name, module in model.named_modules():
        m = _MOE_BLOCK.search(name)
        if m and isinstance(getattr(module, "experts", None), torch.nn.Module):
            blocks[int(m.group(1))] = module
    return blocks


def use_remote_experts(
    model: torch.nn.Module, client: ExpertClient, *, timeout: float | None = None
) -> dict[int, RemoteExperts]:
    """Replace every MoE block's experts with `RemoteExperts(client, L)`; returns them by L."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(
            "the model has no MoE block with an `experts` module under layers.<L>.(mlp|"
            "block_sparse_moe|feed_forward)"
        )
    remote = {}
    for layer, block in sorted(blocks.items()):
        remote[layer] = RemoteExperts(client, layer, timeout=timeout)
        block.experts = remote[layer]
    return remote


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors file")
    return files


def load_unquantized_weights(model: torch.nn.Module, path: str | os.PathLike) -> list[str]:
    """Load every parameter and buffer of `model` outside its MoE blocks' `experts` from the
    checkpoint at `path`, converted to the model's dtypes. Raises KeyError naming the
    tensors the checkpoint lacks (tied weights, such as a tied lm_head, excepted) and
    ValueError for a shape that differs. Returns the names loaded."""
    state = model.state_dict()
    wanted = {n for n in state if ".experts." not in n}
    loaded = []
    for file in _checkpoint_files(Path(path)):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name not in wanted:
                    continue
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(state[name].shape):
                    raise ValueError(
                        f"{file.name}: {name} has shape {list(tensor.shape)}, the model "
                        f"expects {list(state[name].shape)}"
                    )
                with torch.no_grad():
                    state[name].copy_(tensor.to(state[name].dtype))
                loaded.append(name)
    # Tied parameters share storage: loading one loads the other. Buffers (rotary tables)
    # are the model's own.
    params = dict(model.named_parameters(remove_duplicate=False))
    seen = {state[n].data_ptr() for n in loaded}
    missing = sorted(
        n for n in wanted - set(loaded) if n in params and state[n].data_ptr() not in seen
    )
    if missing:
        raise KeyError(f"{path} lacks {len(missing)} of the model's tensors: {missing[:8]}")
    return loaded
