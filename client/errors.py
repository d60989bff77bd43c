"""Client errors: each names the experts and addresses involved."""

from __future__ import annotations


class ExpertdError(RuntimeError):
    """Base of every error the client raises."""


class CoverageError(ExpertdError):
    """Some routed experts are owned by no reachable shard: never a silent zero."""

    def __init__(self, layer: int, experts: list[int], unreachable: dict[str, str]) -> None:
        self.layer = layer
        self.experts = experts
        self.unreachable = unreachable
        where = (
            "; unreachable: " + ", ".join(f"{a} ({why})" for a, why in unreachable.items())
            if unreachable
            else "; every address answered, none owns them"
        )
        super().__init__(
            f"layer {layer}: experts {_short(experts)} are served by no reachable shard{where}"
        )


class ShardCallError(ExpertdError):
    """A shard's Forward failed (its gRPC status is kept in `code`)."""

    def __init__(self, address: str, layer: int, experts: list[int], code, details: str) -> None:
        self.address = address
        self.layer = layer
        self.experts = experts
        self.code = code
        self.details = details
        name = getattr(code, "name", str(code))
        super().__init__(
            f"shard {address} failed layer {layer} (experts {_short(experts)}): {name}: {details}"
        )


def _short(values: list[int], limit: int = 16) -> str:
    text = ",".join(map(str, values[:limit]))
    return text + (f",... ({len(values)} in all)" if len(values) > limit else "")
