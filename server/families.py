"""Model families: the expert configuration read from a checkpoint's config, and the
tensor-name layouts of the families expertd loads (docs/models.md).

A checkpoint directory holds `config.json` (the model's Hugging Face config) and,
for a ModelOpt export, `hf_quant_config.json`. From them comes an `ExpertConfig`:
H, I, E, top_k, the activation, whether top-k weights are renormalized, a routed
scaling factor, and the quantization algorithm. Combinations expertd cannot serve
are refused here, with a message naming the field.

The router, shared experts, dense layers and attention stay with the frontend:
`norm_topk_prob` and `routed_scaling_factor` are what the frontend's router applies
before it sends `topk_weights` (docs/protocol.md, section 2); a shard only reports them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "config.json"
QUANT_CONFIG_FILE = "hf_quant_config.json"

# The quantization algorithms whose expert weights expertd reads: NVFP4 (W4A4; the input
# scales are ignored, a shard computes W4A16) and W4A16_NVFP4 (no input scales).
QUANT_ALGOS = ("NVFP4", "W4A16_NVFP4")
GROUP_SIZE = 16
ACTIVATIONS = ("silu", "swish")  # the experts compute silu(gate) * up

# config.json field -> the names families use for it, most specific first.
CONFIG_KEYS = {
    "hidden_size": ("hidden_size",),
    # Qwen3-MoE and DeepSeek-V3 name the expert width moe_intermediate_size (their
    # intermediate_size is the dense layers'); Mixtral and Llama-4 call it intermediate_size.
    "moe_intermediate_size": ("moe_intermediate_size", "intermediate_size"),
    # hub configs say num_experts (Qwen3-MoE) or n_routed_experts (DeepSeek-V3);
    # transformers 5 writes num_local_experts (Qwen3-MoE, Mixtral, Llama-4).
    "num_experts": ("num_experts", "n_routed_experts", "num_local_experts"),
    "num_experts_per_tok": ("num_experts_per_tok", "moe_topk"),
    "hidden_act": ("hidden_act", "hidden_activation"),
    "norm_topk_prob": ("norm_topk_prob",),
    "routed_scaling_factor": ("routed_scaling_factor",),
}


class ConfigError(ValueError):
    """The model's configuration asks for something expertd cannot serve."""


@dataclass(frozen=True, slots=True)
class Layout:
    """Where one family keeps its routed experts' tensors.

    {prefix}layers.{L}.{block}.experts.{e}.{gate|up|down}.{weight|weight_scale|weight_scale_2}
    """

    name: str
    block: str  # the MoE module under a decoder layer: "mlp", "block_sparse_moe"
    gate: str
    up: str
    down: str

    @property
    def projections(self) -> tuple[str, str, str]:
        """The file's names of (gate, up, down), in the order expertd stacks them."""
        return (self.gate, self.up, self.down)


LAYOUTS = {
    # Qwen2/3-MoE, DeepSeek-V2/V3/R1, and expertd's own synthetic checkpoints.
    "mlp": Layout("mlp", "mlp", "gate_proj", "up_proj", "down_proj"),
    # Mixtral: w1 is gate, w3 up, w2 down.
    "block_sparse_moe": Layout("block_sparse_moe", "block_sparse_moe", "w1", "w3", "w2"),
}


@dataclass(frozen=True, slots=True)
class FusedLayout:
    """Every expert of a layer in one tensor per projection (Llama-4, as ModelOpt exports it):

        {prefix}layers.{L}.{block}.experts.{gate_up}{suffix}   uint8 [E, H/2, 2I], gate's I first
        {prefix}layers.{L}.{block}.experts.{down}{suffix}      uint8 [E, I/2, H]

    packed along the input dimension (a byte holds inputs 2j, low nibble, and 2j + 1), so
    one expert's [in/2, out] slice, transposed, is the per-expert [out, in/2] layout byte
    for byte. Suffixes (FUSED_SUFFIXES): the codes, `_weight_scale` (fp8 [E, in/16, out])
    and `_weight_scale_2` (one fp32 per layer and tensor, shared by its experts)."""

    name: str
    block: str
    gate_up: str
    down: str


FUSED_LAYOUTS = {
    "feed_forward": FusedLayout("feed_forward", "feed_forward", "gate_up_proj", "down_proj"),
}
FUSED_SUFFIXES = ("", "_weight_scale", "_weight_scale_2")


def layout_named(name: str) -> Layout | FusedLayout:
    return LAYOUTS[name] if name in LAYOUTS else FUSED_LAYOUTS[name]


@dataclass(frozen=True, slots=True)
class Family:
    """A known model family: its architectures (config.json) and routed-expert layout."""

    name: str
    architectures: tuple[str, ...]
    layout: str
    presets: tuple[str, ...]  # synthetic presets of this family's released shapes


FAMILIES = (
    Family("qwen3-moe", ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"), "mlp",
           ("qwen3-235b-a22b", "qwen3-30b-a3b")),
    Family("deepseek-v3", ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"), "mlp",
           ("deepseek-v3",)),
    Family("mixtral", ("MixtralForCausalLM",), "block_sparse_moe", ()),
    Family("llama-4", ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"), "feed_forward",
           ("llama4-scout", "llama4-maverick")),
    Family("muse-spark", (), "mlp", ("muse-spark", "small")),
)  # fmt: skip


def family_of(architectures: list[str] | tuple[str, ...] | None) -> Family | None:
    for family in FAMILIES:
        if any(a in family.architectures for a in architectures or ()):
            return family
    return None


@dataclass(frozen=True, slots=True)
class ExpertConfig:
    """What a shard needs to know of the model, from its config (None: not stated)."""

    hidden_size: int | None = None  # H
    intermediate_size: int | None = None  # I, the routed experts' width
    num_experts: int | None = None  # E, routed experts per layer
    top_k: int | None = None  # experts per token
    activation: str = "silu"
    norm_topk_prob: bool | None = None  # applied by the frontend's router
    routed_scaling_factor: float = 1.0  # applied by the frontend's router
    quant_algo: str | None = None  # "NVFP4" or "W4A16_NVFP4"
    exclude_modules: tuple[str, ...] = ()  # glob patterns left unquantized
    architecture: str | None = None
    family: str | None = None

    def describe(self) -> str:
        parts = [f"family={self.family or 'unknown'}", f"act={self.activation}"]
        if self.quant_algo:
            parts.append(f"quant={self.quant_algo}")
        if self.norm_topk_prob is not None:
            parts.append(f"norm_topk_prob={self.norm_topk_prob}")
        if self.routed_scaling_factor != 1.0:
            parts.append(f"routed_scaling_factor={self.routed_scaling_factor}")
        return ", ".join(parts)


def _lookup(config: dict, keys: tuple[str, ...]) -> tuple[str | None, object]:
    """(the key found, its value) in config or its text_config (multimodal configs)."""
    for scope in (config, config.get("text_config") or {}):
        if not isinstance(scope, dict):
            continue
        for key in keys:
            if key in scope and scope[key] is not None:
                return key, scope[key]
    return None, None


def _positive_int(where: str, field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {field} = {value!r}, expected a positive integer")
    return value


def quant_settings(config: dict, quant: dict | None) -> tuple[str | None, tuple[str, ...]]:
    """(quant_algo, exclude_modules) from hf_quant_config.json or config.json's
    quantization_config; refuses an algorithm or group size expertd cannot read."""
    if quant is not None:
        where, body = QUANT_CONFIG_FILE, quant.get("quantization", quant)
        field = "quantization."
    elif isinstance(config.get("quantization_config"), dict):
        where, body = CONFIG_FILE, config["quantization_config"]
        field = "quantization_config."
    else:
        return None, ()
    if not isinstance(body, dict):
        raise ConfigError(f"{where}: {field.rstrip('.')} is not a JSON object")
    method = body.get("quant_method")
    if method is not None and str(method).lower() != "modelopt":
        raise ConfigError(
            f"{where}: {field}quant_method = {method!r}; expertd reads ModelOpt NVFP4 "
            "exports (quant_method 'modelopt')"
        )
    algo = body.get("quant_algo")
    if algo is not None and algo not in QUANT_ALGOS:
        raise ConfigError(
            f"{where}: {field}quant_algo = {algo!r} is not supported; expertd serves "
            f"{' or '.join(QUANT_ALGOS)} experts"
        )
    group = body.get("group_size")
    if group is None and isinstance(body.get("config_groups"), dict):
        for group_cfg in body["config_groups"].values():
            weights = group_cfg.get("weights") if isinstance(group_cfg, dict) else None
            if isinstance(weights, dict) and weights.get("group_size") is not None:
                group = weights["group_size"]
    if group is not None and group != GROUP_SIZE:
        raise ConfigError(
            f"{where}: {field}group_size = {group!r}; NVFP4 has one fp8 scale per "
            f"{GROUP_SIZE} weights"
        )
    exclude = body.get("exclude_modules") or body.get("ignore") or ()
    return algo, tuple(str(p) for p in exclude)


def expert_config(
    config: dict, quant: dict | None = None, where: str = CONFIG_FILE
) -> ExpertConfig:
    """The expert configuration stated by a config.json (and hf_quant_config.json), checked."""
    values: dict[str, object] = {}
    for field in ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok"):
        key, value = _lookup(config, CONFIG_KEYS[field])
        values[field] = None if key is None else _positive_int(where, key, value)
    h, i = values["hidden_size"], values["moe_intermediate_size"]
    e, k = values["num_experts"], values["num_experts_per_tok"]
    for field, size in (("hidden_size", h), ("moe_intermediate_size", i)):
        if size is not None and size % GROUP_SIZE:
            raise ConfigError(
                f"{where}: {field} = {size} is not a multiple of {GROUP_SIZE} (one NVFP4 "
                "scale block)"
            )
    if k is not None and e is not None and k > e:
        raise ConfigError(f"{where}: num_experts_per_tok = {k} exceeds the {e} routed experts")
    key, act = _lookup(config, CONFIG_KEYS["hidden_act"])
    if act is not None and act not in ACTIVATIONS:
        raise ConfigError(
            f"{where}: {key} = {act!r} is not supported; expertd's experts compute silu(gate) * up"
        )
    _, norm_topk = _lookup(config, CONFIG_KEYS["norm_topk_prob"])
    key, scaling = _lookup(config, CONFIG_KEYS["routed_scaling_factor"])
    if scaling is not None and (isinstance(scaling, bool) or not isinstance(scaling, int | float)):
        raise ConfigError(f"{where}: {key} = {scaling!r}, expected a number")
    algo, exclude = quant_settings(config, quant)
    architectures = config.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    family = family_of(architectures)
    expertd = config.get("expertd")
    if family is None and isinstance(expertd, dict):  # our synthetic checkpoints
        family = next((f for f in FAMILIES if expertd.get("preset") in f.presets), None)
    return ExpertConfig(
        hidden_size=h,
        intermediate_size=i,
        num_experts=e,
        top_k=k,
        activation="silu",
        norm_topk_prob=bool(norm_topk) if norm_topk is not None else None,
        routed_scaling_factor=float(scaling) if scaling is not None else 1.0,
        quant_algo=algo,
        exclude_modules=exclude,
        architecture=architectures[0] if architectures else None,
        family=family.name if family else None,
    )


def read_json(path: Path, error: type[ValueError] = ConfigError) -> dict | None:
    """A JSON object from `path`, None when the file is absent."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except ValueError as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object")
    return value


def read_expert_config(directory: str | Path) -> ExpertConfig:
    """`expert_config` of the config.json and hf_quant_config.json in `directory`."""
    directory = Path(directory)
    config = read_json(directory / CONFIG_FILE) or {}
    quant = read_json(directory / QUANT_CONFIG_FILE)
    return expert_config(config, quant, str(directory / CONFIG_FILE))
