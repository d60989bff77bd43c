"""The shard server: checkpoints, the expert bank, the gRPC services, the CLI."""
