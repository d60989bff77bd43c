"""The client SDK: discovery, routing, fan-out, the sum."""
