"""Client errors: each names the layer, the experts and the addresses involved,
so an operator reading one line knows what is missing and where to look."""

from __future__ import annotations


class ExpertdError(RuntimeError):
    """Base of every error the client raises."""


class CoverageError(ExpertdError):
    """Some routed experts have no live owner: raised instead of a silent zero.

    `unreachable` maps each address that might have served them (down, or never
    described) to why it is out of rotation."""

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
    """A shard's Forward failed for good: a status that retrying cannot fix, the
    deadline, or every replica tried. `code` is the last gRPC status, `attempts`
    maps each address tried to its failure."""

    def __init__(
        self,
        address: str,
        layer: int,
        experts: list[int],
        code,
        details: str,
        attempts: dict[str, str] | None = None,
    ) -> None:
        self.address = address
        self.layer = layer
        self.experts = experts
        self.code = code
        self.details = details
        self.attempts = attempts or {address: f"{getattr(code, 'name', code)}: {details}"}
        name = getattr(code, "name", str(code))
        tried = (
            "; tried " + ", ".join(f"{a} ({why})" for a, why in self.attempts.items())
            if len(self.attempts) > 1
            else ""
        )
        super().__init__(
            f"shard {address} failed layer {layer} (experts {_short(experts)}): "
            f"{name}: {details}{tried}"
        )


def _short(values: list[int], limit: int = 16) -> str:
    text = ",".join(map(str, values[:limit]))
    return text + (f",... ({len(values)} in all)" if len(values) > limit else "")
