"""NVFP4 checkpoints on disk (docs/protocol.md, docs/models.md): the synthetic writer and
the lazy reader of ModelOpt exports and of our own checkpoints.

Layout, one safetensors file per layer plus an index (Hugging Face convention):

    DIR/model-00001-of-0000N.safetensors   layer 0: every expert's 9 tensors (+ the norm)
    DIR/model.safetensors.index.json       {"metadata": {...}, "weight_map": {name: file}}
    DIR/config.json                        hidden_size, moe_intermediate_size, num_experts, ...
    DIR/hf_quant_config.json               a ModelOpt export's quant_algo, group_size, ...

    {prefix}layers.{L}.{block}.experts.{e}.{gate|up|down}.{weight|weight_scale|weight_scale_2}
    {prefix}layers.{L}.mlp.post_expert_norm.weight        (muse-spark layers only)

`block` and the projections' names are the family's (server/families.py: `mlp` with
gate_proj/up_proj/down_proj for Qwen3-MoE, DeepSeek-V3 and ours; `block_sparse_moe`
with w1/w3/w2 for Mixtral), found from the names. Every other tensor (attention,
router, shared experts, dense layers, `input_scale`) is the frontend's and ignored.

The reader also takes one file, or several without an index. It reads headers
only when opened; `load_layer` then reads just the experts a shard owns, each
tensor checked (presence, dtype, shape) against its header before its bytes are
touched, so a bad checkpoint fails with a message naming the tensor.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from expertd.kernels.layer import ShardLayer
from expertd.kernels.nvfp4 import BLOCK, Nvfp4Weight
from expertd.server.families import (
    CONFIG_FILE,
    FUSED_LAYOUTS,
    FUSED_SUFFIXES,
    LAYOUTS,
    QUANT_CONFIG_FILE,
    ConfigError,
    ExpertConfig,
    FusedLayout,
    Layout,
    expert_config,
    family_of,
    layout_named,
    read_json,
)
from expertd.server.synthetic import (
    PRESETS,
    PROJECTIONS,
    Preset,
    expert_projection,
    norm_weight,
)

INDEX_FILE = "model.safetensors.index.json"
PARTS = ("weight", "weight_scale", "weight_scale_2")

# safetensors header dtype -> torch dtype (for checks and messages).
_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
    "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


class CheckpointError(ValueError):
    """The checkpoint is missing something, or holds a tensor of the wrong dtype or shape."""


def expert_name(
    prefix: str, layer: int, expert: int, proj: str, part: str, block: str = "mlp"
) -> str:
    return f"{prefix}layers.{layer}.{block}.experts.{expert}.{proj}.{part}"


def norm_name(prefix: str, layer: int) -> str:
    return f"{prefix}layers.{layer}.mlp.post_expert_norm.weight"


def shard_file_name(index: int, total: int) -> str:
    """Hugging Face shard naming, 1-based: model-00001-of-00004.safetensors."""
    return f"model-{index + 1:05d}-of-{total:05d}.safetensors"


# --------------------------------------------------------------------------- writer


def write_checkpoint(
    path: str | os.PathLike,
    preset: Preset,
    layers: int,
    seed: int,
    *,
    prefix: str = "model.",
    progress: Callable[[int, int, int], None] | None = None,
    device: torch.device | str = "cpu",
    overwrite: bool = False,
) -> None:
    """Write `layers` synthetic layers of `preset` to directory `path`.

    The tensors are exactly those of `synthetic.expert_projection` / `norm_weight`,
    so a server using `synthetic_layer(preset, seed, ...)` holds bit-identical
    weights. One layer is in memory at a time (a muse-spark layer is ~6.9 GB).
    Everything is written into a hidden sibling directory, the index last, which is
    then renamed onto `path`: an interrupted run never leaves a checkpoint that
    looks complete. `path` must not exist or be an empty directory, unless
    `overwrite`. `progress(layer_index, layers, bytes_written)` is called after
    each layer reaches disk (`bytes_written` counts all layers so far). `device`
    is where the quantization runs (the result is identical on any device).
    """
    path = Path(path)
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if path.exists() and not overwrite and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not an empty directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; a server may run as another user
        weight_map: dict[str, str] = {}
        total = 0
        for layer in range(layers):
            file = shard_file_name(layer, layers)
            tensors = _layer_tensors(preset, seed, layer, prefix, device)
            save_file(tensors, tmp / file, metadata={"format": "pt"})
            (tmp / file).chmod(0o644)
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update(dict.fromkeys(tensors, file))
            del tensors
            if progress is not None:
                progress(layer, layers, total)
        config = {
            "hidden_size": preset.hidden_size,
            "moe_intermediate_size": preset.intermediate_size,
            "num_experts": preset.num_experts,
            "num_experts_per_tok": preset.top_k,
            "num_hidden_layers": layers,
            "hidden_act": "silu",
            "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"},
            "expertd": {"preset": preset.name, "seed": seed, "prefix": prefix},
        }
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _layer_tensors(
    preset: Preset, seed: int, layer: int, prefix: str, device: torch.device | str
) -> dict[str, torch.Tensor]:
    tensors = {}
    for e in range(preset.num_experts):
        for proj in PROJECTIONS:
            w = expert_projection(preset, seed, layer, e, proj, device)
            for part, t in zip(PARTS, (w.weight, w.weight_scale, w.weight_scale_2), strict=True):
                tensors[expert_name(prefix, layer, e, proj, part)] = t.cpu().contiguous()
    if preset.post_norm:
        tensors[norm_name(prefix, layer)] = norm_weight(preset, seed, layer).contiguous()
    return tensors


# --------------------------------------------------------------------------- reader


class CheckpointReader:
    """Headers of an NVFP4 checkpoint at open; owned experts' tensors on demand.

    `path`: a directory with `model.safetensors.index.json`, a directory of
    `*.safetensors` files, or one `.safetensors` file. The family's layout comes from
    the tensor names; H, I and E from the tensor shapes and names. `config.json`
    (and a ModelOpt export's `hf_quant_config.json`) beside the weights, when
    present, is checked (server/families.py: unsupported settings are refused
    naming the field), cross-checked against the tensors, and supplies `top_k`.
    """

    def __init__(self, path: str | os.PathLike, prefix: str = "model.") -> None:
        self.path = Path(path)
        self.prefix = prefix
        self._files, self._index = self._find_files()
        # name -> (file, safetensors dtype, shape), for our tensors only.
        self._entries: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
        others: list[str] = []
        for file in self._files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    if name.startswith(prefix):
                        sl = f.get_slice(name)
                        self._entries[name] = (file, sl.get_dtype(), tuple(sl.get_shape()))
                    elif len(others) < 10_000:
                        others.append(name)
        self.config, quant = self._read_configs()
        try:
            self.expert_config: ExpertConfig = expert_config(
                self.config, quant, str(self._dir / CONFIG_FILE)
            )
        except ConfigError as exc:
            raise CheckpointError(str(exc)) from None
        self.layout = self._find_layout(others)
        self._discover()
        self._check_config()
        self.top_k: int | None = self.expert_config.top_k
        if self.top_k is not None and self.top_k > self.num_experts:
            raise CheckpointError(
                f"config.json num_experts_per_tok = {self.top_k} exceeds the "
                f"{self.num_experts} experts in {self.path}"
            )

    # -- opening

    @property
    def _dir(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent

    def _find_files(self) -> tuple[list[Path], dict[str, str]]:
        p = self.path
        if p.is_file():
            if p.suffix != ".safetensors":
                raise CheckpointError(f"{p} is not a .safetensors file")
            return [p], {}
        if not p.is_dir():
            raise CheckpointError(f"checkpoint {p} does not exist")
        index_path = p / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index_path}: not a safetensors index ({exc})") from None
            files = sorted({p / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index_path} names files that are absent: {missing}")
            return files, weight_map
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{p} holds no *.safetensors file and no {INDEX_FILE}")
        return files, {}

    def _read_configs(self) -> tuple[dict, dict | None]:
        config = read_json(self._dir / CONFIG_FILE, CheckpointError) or {}
        quant = read_json(self._dir / QUANT_CONFIG_FILE, CheckpointError)
        return config, quant

    def _find_layout(self, others: list[str]) -> Layout | FusedLayout:
        """The family's expert layout, from the routed-expert tensors' names."""
        head = re.escape(self.prefix) + r"layers\.\d+\.(\w+)\.experts\.\d+\.(\w+)\."
        names = {(m.group(1), m.group(2)) for n in self._entries if (m := re.match(head, n))}
        fused_head = re.escape(self.prefix) + r"layers\.\d+\.(\w+)\.experts\.(\w+)$"
        fused = {(m.group(1), m.group(2)) for n in self._entries if (m := re.match(fused_head, n))}
        found: Layout | FusedLayout | None = None
        for layout in LAYOUTS.values():
            if any(block == layout.block and proj in layout.projections for block, proj in names):
                found = layout
                break
        else:
            for layout in FUSED_LAYOUTS.values():
                if (layout.block, layout.gate_up) in fused:
                    found = layout
                    break
        if found is not None:
            family = family_of([self.expert_config.architecture or ""])
            if family is not None and layout_named(family.layout) != found:
                raise CheckpointError(
                    f"{self.path}: config.json architectures = "
                    f"{self.expert_config.architecture!r} keeps its experts under "
                    f"'{layout_named(family.layout).block}', but the tensors are under "
                    f"'{found.block}'"
                )
            return found
        # Name the prefix the experts are under, when they are under another one.
        anywhere = re.compile(
            r"(.*?)layers\.\d+\.(?:(?:mlp|block_sparse_moe)\.experts\.\d+\."
            r"|feed_forward\.experts\.gate_up_proj$)"
        )
        hint = next((m.group(1) for n in others if (m := anywhere.match(n))), None)
        found_at = f"; the experts are under the prefix {hint!r}" if hint is not None else ""
        known = ", ".join(
            [f"{lay.block}.experts.<e>.{lay.gate}" for lay in LAYOUTS.values()]
            + [f"{lay.block}.experts.{lay.gate_up}" for lay in FUSED_LAYOUTS.values()]
        )
        raise CheckpointError(
            f"{self.path}: no tensor named {self.prefix}layers.<L>.<block>.experts.<e>.* "
            f"(known: {known}; is the prefix {self.prefix!r} right?{found_at})"
        )

    @property
    def fused(self) -> bool:
        """Every expert of a layer in one tensor per projection (FusedLayout)."""
        return isinstance(self.layout, FusedLayout)

    def fused_name(self, layer: int, proj: str, suffix: str = "") -> str:
        """The file's name of a fused layout's tensor (`proj`: gate_up or down)."""
        return f"{self.prefix}layers.{layer}.{self.layout.block}.experts.{proj}{suffix}"

    def _discover_fused(self) -> None:
        """Layers from the fused tensors' names; H, I and E from their shapes."""
        lay = self.layout
        pattern = re.compile(
            re.escape(self.prefix) + rf"layers\.(\d+)\.{lay.block}\.experts\.{lay.gate_up}$"
        )
        shapes = {}
        for name, (_file, _dtype, shape) in self._entries.items():
            if m := pattern.match(name):
                if len(shape) != 3 or shape[2] % 2:
                    raise CheckpointError(
                        f"tensor {name}: shape {list(shape)}, expected [E, H/2, 2I]"
                    )
                shapes[int(m.group(1))] = (2 * shape[1], shape[2] // 2, shape[0])
        self.layers = sorted(shapes)
        self.post_norm = False
        distinct = set(shapes.values())
        if len(distinct) > 1:
            detail = ", ".join(f"layer {L}: H={h} I={i} E={e}" for L, (h, i, e) in shapes.items())
            raise CheckpointError(f"{self.path}: layers disagree on their shapes ({detail})")
        self.hidden_size, self.intermediate_size, self.num_experts = distinct.pop()

    def _discover(self) -> None:
        """Find layers and expert ids from names; H, I, E from shapes; all layers must agree."""
        if self.fused:
            self._discover_fused()
            return
        lay = self.layout
        pattern = re.compile(
            re.escape(self.prefix) + rf"layers\.(\d+)\.{lay.block}\.experts\.(\d+)\."
            rf"(?:{lay.gate}|{lay.up}|{lay.down})\."
        )
        norms = re.compile(re.escape(self.prefix) + r"layers\.(\d+)\.mlp\.post_expert_norm\.")
        max_expert: dict[int, int] = {}
        norm_layers = set()
        for name in self._entries:
            m = pattern.match(name)
            if m:
                layer, e = int(m.group(1)), int(m.group(2))
                max_expert[layer] = max(max_expert.get(layer, -1), e)
            elif m := norms.match(name):
                norm_layers.add(int(m.group(1)))
        self.layers = sorted(max_expert)
        # A post-expert norm (muse-spark) is a property of the model: every layer has one
        # when any does, or when our own config says the preset has one.
        ours = self.config.get("expertd")
        preset = ours.get("preset") if isinstance(ours, dict) else None
        known = isinstance(preset, str) and preset in PRESETS
        self.post_norm = bool(norm_layers) or (known and PRESETS[preset].post_norm)
        shapes = {}
        for layer in self.layers:
            # The shape most experts agree on, so one bad expert is reported by name
            # when it is loaded rather than skewing H and I for everyone.
            found = Counter(
                self._entries[n][2]
                for e in range(max_expert[layer] + 1)
                if (n := self.name(layer, e, lay.gate, "weight")) in self._entries
            )
            if not found or len(found.most_common(1)[0][0]) != 2:
                raise CheckpointError(
                    f"layer {layer}: no {lay.block}.experts.<e>.{lay.gate}.weight of shape [I, H/2]"
                )
            (i, half_h), _ = found.most_common(1)[0]
            shapes[layer] = (2 * half_h, i, max_expert[layer] + 1)
        distinct = set(shapes.values())
        if len(distinct) > 1:
            detail = ", ".join(f"layer {L}: H={h} I={i} E={e}" for L, (h, i, e) in shapes.items())
            raise CheckpointError(f"{self.path}: layers disagree on their shapes ({detail})")
        self.hidden_size, self.intermediate_size, self.num_experts = distinct.pop()
        # An expert id absent from every layer's names still counts when the config says E.
        stated = self.expert_config.num_experts
        if stated is not None and stated > self.num_experts:
            self.num_experts = stated

    def _check_config(self) -> None:
        ours = {
            "hidden_size": self.hidden_size,
            "moe_intermediate_size": self.intermediate_size,
            "num_experts": self.num_experts,
        }
        stated = {
            "hidden_size": self.expert_config.hidden_size,
            "moe_intermediate_size": self.expert_config.intermediate_size,
            "num_experts": self.expert_config.num_experts,
        }
        for field, value in stated.items():
            if value is not None and value != ours[field]:
                raise CheckpointError(
                    f"config.json {field} = {value}, but the tensors in {self.path} "
                    f"give {ours[field]}"
                )

    # -- properties

    def name(self, layer: int, expert: int, proj: str, part: str) -> str:
        """The file's name of one tensor of a routed expert (`proj` in the file's naming)."""
        return expert_name(self.prefix, layer, expert, proj, part, self.layout.block)

    @property
    def description(self) -> str:
        layers = self.layers
        span = f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else f"{layers[0]}"
        return (
            f"{self.path} ({len(self._files)} file{'s' * (len(self._files) != 1)}, "
            f"{len(layers)} layer{'s' * (len(layers) != 1)} [{span}], E={self.num_experts}, "
            f"H={self.hidden_size}, I={self.intermediate_size}, top_k={self.top_k}, "
            f"{self.expert_config.describe()}, post-expert norm {'yes' if self.post_norm else 'no'})"
        )

    def expected(self, name: str) -> tuple[torch.dtype, tuple[tuple[int, ...], ...]]:
        """The dtype and the accepted shapes of one of our tensors, by its name's ending."""
        h, i = self.hidden_size, self.intermediate_size
        if name.endswith(".post_expert_norm.weight"):
            return torch.bfloat16, ((h,),)
        if self.fused:  # [E, in/2, out] codes, [E, in/16, out] scales, one global scale
            e = self.num_experts
            n, k = (h, i) if f".experts.{self.layout.down}" in name else (2 * i, h)
            if name.endswith("_weight_scale_2"):
                return torch.float32, ((), (1,))
            if name.endswith("_weight_scale"):
                return torch.float8_e4m3fn, ((e, k // BLOCK, n),)
            return torch.uint8, ((e, k // 2, n),)
        n, k = (h, i) if f".{self.layout.down}." in name else (i, h)
        if name.endswith(".weight_scale_2"):
            return torch.float32, ((), (1,))
        if name.endswith(".weight_scale"):
            return torch.float8_e4m3fn, ((n, k // BLOCK),)
        return torch.uint8, ((n, k // 2),)

    # -- loading

    def _check_layer(self, layer: int, experts: list[int]) -> None:
        if layer not in self.layers:
            raise CheckpointError(
                f"layer {layer} is not in checkpoint {self.path} "
                f"(it holds layers {', '.join(map(str, self.layers))})"
            )
        bad = [e for e in experts if not 0 <= e < self.num_experts]
        if bad or len(set(experts)) != len(experts):
            raise CheckpointError(
                f"experts {experts} must be distinct ids in [0, {self.num_experts})"
            )

    def _layer_names(self, layer: int, experts: list[int]) -> list[str]:
        if self.fused:  # every expert's tensors are slices of these
            lay = self.layout
            return [
                self.fused_name(layer, proj, suffix)
                for proj in (lay.gate_up, lay.down)
                for suffix in FUSED_SUFFIXES
            ]
        names = [
            self.name(layer, e, proj, part)
            for e in experts
            for proj in self.layout.projections
            for part in PARTS
        ]
        return [*names, norm_name(self.prefix, layer)] if self.post_norm else names

    def _excluded(self, name: str) -> str | None:
        """The exclude_modules pattern that left `name`'s module unquantized, if any."""
        module = name.rsplit(".", 1)[0]
        for pattern in self.expert_config.exclude_modules:
            if fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(
                module.removeprefix(self.prefix), pattern
            ):
                return pattern
        return None

    def _validate(self, name: str, layer: int) -> tuple[Path, tuple[int, ...]]:
        """Header of one tensor, checked: present, expected dtype and shape."""
        excluded = self._excluded(name)
        hint = (
            f" ({QUANT_CONFIG_FILE} exclude_modules {excluded!r} left it unquantized; "
            "expertd serves NVFP4 experts only)"
            if excluded
            else ""
        )
        if name not in self._entries:
            where = self._index.get(name)
            if where is None:
                head = f"{self.prefix}layers.{layer}."
                files = {f.name for n, (f, _, _) in self._entries.items() if n.startswith(head)}
                where = ", ".join(sorted(files)) or ", ".join(f.name for f in self._files)
            raise CheckpointError(
                f"missing tensor {name} (looked in {where} under {self.path}){hint}"
            )
        file, st_dtype, shape = self._entries[name]
        dtype, shapes = self.expected(name)
        if _DTYPES.get(st_dtype) != dtype:
            found = (
                str(_DTYPES[st_dtype]).removeprefix("torch.") if st_dtype in _DTYPES else st_dtype
            )
            raise CheckpointError(
                f"tensor {name} in {file.name}: dtype {found}, expected "
                f"{str(dtype).removeprefix('torch.')}{hint}"
            )
        if shape not in shapes:
            raise CheckpointError(
                f"tensor {name} in {file.name}: shape {list(shape)}, expected "
                f"{' or '.join(str(list(s)) for s in shapes)}"
            )
        return file, shape

    def nbytes_for(self, layer: int, experts: list[int]) -> int:
        """Bytes `load_layer(layer, experts)` reads (from the headers; validates them too)."""
        self._check_layer(layer, experts)
        total = 0
        for name in self._layer_names(layer, experts):
            _, shape = self._validate(name, layer)
            numel = 1
            for d in shape:
                numel *= d
            if self.fused and len(shape) == 3:  # only the owned experts' slices are read
                numel = numel // shape[0] * len(experts)
            total += numel * self.expected(name)[0].itemsize
        return total

    def _load_fused(self, layer: int, experts: list[int], read, read_slice, device) -> dict:
        """gate, up and down of `experts`, each expert's slice of the fused tensors
        transposed into the per-expert layout ([out, in/2] codes, [out, in/16] scales)."""
        h, i, el = self.hidden_size, self.intermediate_size, len(experts)
        lay = self.layout
        stacks = {}
        for ours, (n, k) in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            stacks[ours] = Nvfp4Weight(
                torch.empty((el, n, k // 2), dtype=torch.uint8, device=device),
                torch.empty((el, n, k // BLOCK), dtype=torch.float8_e4m3fn, device=device),
                torch.empty((el,), dtype=torch.float32, device=device),
            )
        for proj, parts in ((lay.gate_up, ("gate_proj", "up_proj")), (lay.down, ("down_proj",))):
            codes_name, scale_name, global_name = (
                self.fused_name(layer, proj, suffix) for suffix in FUSED_SUFFIXES
            )
            global_scale = read(global_name).reshape(())
            for slot, e in enumerate(experts):
                codes, scales = read_slice(codes_name, e), read_slice(scale_name, e)
                width = codes.shape[1] // len(parts)  # gate's columns first, then up's
                for j, ours in enumerate(parts):
                    cols = slice(j * width, (j + 1) * width)
                    stacks[ours].weight[slot].copy_(codes[:, cols].T)
                    stacks[ours].weight_scale[slot].copy_(scales[:, cols].T)
                    stacks[ours].weight_scale_2[slot] = global_scale
        return stacks

    def load_layer(
        self, layer: int, experts: list[int], device: torch.device | str = "cpu"
    ) -> ShardLayer:
        """Read only `experts`' tensors of `layer` and stack them, in that order, on `device`."""
        experts = list(experts)
        self._check_layer(layer, experts)
        names = self._layer_names(layer, experts)
        files = {name: self._validate(name, layer)[0] for name in names}  # check all, then read
        h, i, el = self.hidden_size, self.intermediate_size, len(experts)
        stacks: dict[str, Nvfp4Weight] = {}
        with ExitStack() as opened:
            handles: dict[Path, object] = {}

            def read(name: str) -> torch.Tensor:  # each file memory-mapped once per load
                file = files[name]
                if file not in handles:
                    handles[file] = opened.enter_context(safe_open(file, framework="pt"))
                return handles[file].get_tensor(name)

            def read_slice(name: str, e: int) -> torch.Tensor:  # expert e of a fused tensor
                file = files[name]
                if file not in handles:
                    handles[file] = opened.enter_context(safe_open(file, framework="pt"))
                return handles[file].get_slice(name)[e : e + 1][0]

            if self.fused:
                stacks = self._load_fused(layer, experts, read, read_slice, device)
            per_expert = () if self.fused else self.layout.projections
            for ours, proj in zip(PROJECTIONS[: len(per_expert)], per_expert, strict=True):
                n, k = (h, i) if ours == "down_proj" else (i, h)
                out = (
                    torch.empty((el, n, k // 2), dtype=torch.uint8, device=device),
                    torch.empty((el, n, k // BLOCK), dtype=torch.float8_e4m3fn, device=device),
                    torch.empty((el,), dtype=torch.float32, device=device),
                )
                for slot, e in enumerate(experts):
                    for part, dst in zip(PARTS, out, strict=True):
                        dst[slot].copy_(
                            read(self.name(layer, e, proj, part)).reshape(dst[slot].shape)
                        )
                stacks[ours] = Nvfp4Weight(*out)
            norm = read(norm_name(self.prefix, layer)).to(device) if self.post_norm else None
        return ShardLayer(
            experts=tuple(experts),
            num_experts=self.num_experts,
            gate=stacks["gate_proj"],
            up=stacks["up_proj"],
            down=stacks["down_proj"],
            norm_weight=norm,
        )
