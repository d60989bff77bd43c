"""The client SDK: discovery, replicas and failover, routing, fan-out, the sum."""

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
