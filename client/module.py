"""RemoteExperts: a model's MoE experts, served remotely, as a torch module.

    block.experts = RemoteExperts(client, layer=i)   # was: the local experts

forward(hidden_states [..., H], topk_ids [..., K], topk_weights [..., K]) returns
the layer's expert output in hidden_states' shape, dtype and device: the sum
over routes of weight * expert(x), post-expert norm included (docs/protocol.md).
It holds no parameters: the weights live on the shard servers.
"""

from __future__ import annotations

import torch

from expertd.client.sync import ExpertClient


class RemoteExperts(torch.nn.Module):
    def __init__(self, client: ExpertClient, layer: int, *, timeout: float | None = None) -> None:
        super().__init__()
        self.client = client
        self.layer = layer
        self.timeout = timeout

    def forward(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        shape = hidden_states.shape
        out = self.client.forward(
            self.layer,
            hidden_states.reshape(-1, shape[-1]),
            topk_ids.reshape(-1, topk_ids.shape[-1]),
            topk_weights.reshape(-1, topk_weights.shape[-1]),
            timeout=self.timeout,
        )
        return out.reshape(shape).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, shards={len(self.client.addresses)}"
