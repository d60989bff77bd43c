"""The client SDK: discovery, replicas and failover, routing, fan-out, the sum."""

try:
    import torch  # noqa: F401  (the client takes and returns torch tensors)
except ImportError as e:  # `pip install expertd` does not pull torch in on purpose
    raise ImportError(
        "expertd.client needs PyTorch: install the torch build for this machine "
        "(CPU or CUDA) into this environment; `pip install expertd` leaves the choice "
        "to you (docs/operations.md, Installing)"
    ) from e

from expertd.client.aio import AsyncExpertClient
from expertd.client.channels import TLS
from expertd.client.errors import CoverageError, ExpertdError, ShardCallError
from expertd.client.module import RemoteExperts
from expertd.client.sync import ExpertClient

__all__ = [
    "TLS",
    "AsyncExpertClient",
    "CoverageError",
    "ExpertClient",
    "ExpertdError",
    "RemoteExperts",
    "ShardCallError",
]
