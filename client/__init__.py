"""The client SDK: discovery, routing, fan-out, the sum."""

from expertd.client.aio import AsyncExpertClient
from expertd.client.errors import CoverageError, ExpertdError, ShardCallError
from expertd.client.sync import ExpertClient

__all__ = ["AsyncExpertClient", "CoverageError", "ExpertClient", "ExpertdError", "ShardCallError"]
