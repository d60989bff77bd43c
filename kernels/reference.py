"""Plain-torch reference of one shard's expert forward (docs/protocol.md).

It is the oracle of every test and the `reference` backend of the server.

Shape legend:
    M  tokens in the call            K  top_k (routes per token)
    H  hidden width                  I  expert intermediate width
    E  experts in the layer          El experts this shard owns
    R  routes that land on one local expert
"""

from __future__ import annotations

import torch

from expertd.kernels.layer import ShardLayer

RMS_EPS = 1e-8


def dense_weights(layer: ShardLayer, dtype: torch.dtype = torch.float32):
    """Dequantize a shard layer: (w13 [El, 2I, H], w2 [El, H, I], norm [H] or None) in `dtype`."""
    w13 = torch.cat((layer.gate.dequantize(dtype), layer.up.dequantize(dtype)), dim=1)
    w2 = layer.down.dequantize(dtype)
    norm = None if layer.norm_weight is None else layer.norm_weight.to(dtype)
    return w13, w2, norm


def moe_forward_dense(
    w13: torch.Tensor,  # [El, 2I, H]
    w2: torch.Tensor,  # [El, H, I]
    norm_weight: torch.Tensor | None,  # [H], or None: no post-expert norm
    local_of: torch.Tensor,  # int [E + 1]: global id -> local slot or -1; index E is id -1
    x: torch.Tensor,  # [M, H]
    topk_ids: torch.Tensor,  # int [M, K], global ids or -1
    topk_weights: torch.Tensor,  # [M, K]
) -> torch.Tensor:
    """out [M, H] in w13's dtype: sum over owned routes of weight * rmsnorm(expert(x)),
    or of weight * expert(x) for a layer without a post-expert norm."""
    dtype = w13.dtype
    m, h = x.shape
    inter = w2.shape[-1]
    out = torch.zeros((m, h), dtype=dtype, device=x.device)
    if m == 0:
        return out
    # -1 ("no route") indexes the extra last entry of the table, which is -1 too.
    slots = local_of.to(x.device).long()[topk_ids.long() % local_of.numel()]  # [M, K]
    scale = None if norm_weight is None else 1.0 + norm_weight.to(dtype)  # [H]
    for slot in torch.unique(slots[slots >= 0]).tolist():
        token, route = torch.nonzero(slots == slot, as_tuple=True)  # [R], [R]
        xe = x[token].to(dtype)  # [R, H]
        hidden = xe @ w13[slot].T  # [R, 2I]
        act = torch.nn.functional.silu(hidden[:, :inter]) * hidden[:, inter:]  # [R, I]
        z = act @ w2[slot].T  # [R, H]
        if scale is None:
            r = z
        else:
            z = z * scale
            r = z * torch.rsqrt(z.square().mean(dim=-1, keepdim=True) + RMS_EPS)  # [R, H]
        out.index_add_(0, token, r * topk_weights[token, route].to(dtype).unsqueeze(-1))
    return out


def reference_forward(
    layer: ShardLayer,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The oracle: evaluate docs/protocol.md in `dtype` (dequantizing only the experts
    the call hits); returns [M, H] in `dtype`."""
    local_of = layer.global_to_local("cpu")
    slots = local_of.long()[topk_ids.cpu().long() % local_of.numel()]
    hit = torch.unique(slots[slots >= 0])  # [Eh] local slots the call uses
    # Re-number the hit slots 0..Eh-1, so only those experts are dequantized.
    renumber = torch.full((layer.num_local_experts + 1,), -1, dtype=torch.int32)  # [El + 1]
    renumber[hit] = torch.arange(hit.numel(), dtype=torch.int32)
    compact = renumber[local_of.long()]  # [E + 1]; -1 (index El) stays -1

    def pick(w):
        return type(w)(w.weight[hit], w.weight_scale[hit], w.weight_scale_2[hit]).dequantize(dtype)

    dev = x.device
    w13 = torch.cat((pick(layer.gate), pick(layer.up)), dim=1).to(dev)
    w2 = pick(layer.down).to(dev)
    norm = None if layer.norm_weight is None else layer.norm_weight.to(dtype)
    return moe_forward_dense(w13, w2, norm, compact.to(dev), x, topk_ids, topk_weights)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in float64 (0 when both are empty or zero)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    if denom == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / denom
