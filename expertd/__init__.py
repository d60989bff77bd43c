"""expertd: remote mixture-of-experts shards over gRPC."""

__version__ = "0.1.0"
