"""A Hugging Face transformers MoE model as an expertd frontend (docs/models.md).

    model = Qwen3MoeForCausalLM(config)                 # built from the checkpoint's config
    load_unquantized_weights(model, checkpoint_dir)     # attention, router, norms, embeddings
    use_remote_experts(model, client)                   # every MoE block's experts -> shards
    model.generate(...)

transformers cannot load a ModelOpt NVFP4 export back, and the frontend needs none of its
experts: `load_unquantized_weights` reads every other tensor of the export into the model
(the bf16 ones ModelOpt left unquantized) and refuses a missing one. `use_remote_experts`
swaps each MoE block's `experts` module, which transformers 5 calls as
`experts(hidden_states, top_k_index, top_k_weights)`, for `RemoteExperts(client, L)`
(Llama-4's, called densely on router-scaled tokens, for `RemoteScaledExperts`); the
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
        if type(block.experts).__name__ == "Llama4TextExperts":
            remote[layer] = RemoteScaledExperts(
                client, layer, block.experts.num_experts, timeout=timeout
            )
        else:
            remote[layer] = RemoteExperts(client, layer, timeout=timeout)
        block.experts = remote[layer]
    return remote


class RemoteScaledExperts(torch.nn.Module):
    """Llama-4's experts module, served remotely. Llama-4's MoE block scales each token by
    its router score *before* the experts and calls them densely: `experts(routed_in)`
    with routed_in [E * T, H], expert e's copy of every token, the tokens it was not
    routed to zeroed (score 0), and sums the [E * T, H] result over the experts. With one
    expert per token (Llama-4's top-1) that is the picked expert on the scaled token,
    which expertd computes as the route (id, weight 1) on the scaled token; the result
    goes back in the picked expert's rows, zeros elsewhere. More than one nonzero copy
    of a token (top-k > 1, whose routes see differently scaled inputs) is refused."""

    def __init__(self, client: ExpertClient, layer: int, num_experts: int, *, timeout=None) -> None:
        super().__init__()
        self.client = client
        self.layer = layer
        self.num_experts = num_experts
        self.timeout = timeout

    def forward(self, routed_in: torch.Tensor) -> torch.Tensor:
        h = routed_in.shape[-1]
        copies = routed_in.reshape(self.num_experts, -1, h)  # [E, T, H]
        nonzero = (copies != 0).any(dim=-1)  # [E, T]: the experts each token went to
        if (nonzero.sum(dim=0) > 1).any():
            raise ValueError(
                f"layer {self.layer}: a token reaches several experts with differently "
                "scaled inputs; expertd serves Llama-4's top-1 routing only"
            )
        ids = nonzero.to(torch.int8).argmax(dim=0)  # a token sent to none: expert 0, x = 0
        tokens = torch.arange(copies.shape[1], device=routed_in.device)
        x = copies[ids, tokens]
        weights = torch.ones((x.shape[0], 1), dtype=torch.float32, device=x.device)
        out = self.client.forward(
            self.layer, x, ids[:, None].to(torch.int32), weights, timeout=self.timeout
        )
        full = torch.zeros_like(copies)
        full[ids, tokens] = out.to(routed_in.dtype)
        return full.reshape(-1, h)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, experts={self.num_experts}, top-1, scaled inputs"


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
