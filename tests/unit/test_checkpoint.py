"""Checkpoint writer and reader (docs/protocol.md): round trip, layouts, lazy reads, errors.

One 2-layer `small` checkpoint is written per module; the other cases are built
from its tensors with safetensors' own `save_file`, each mutated one way.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from expertd.kernels.layer import ShardLayer
from expertd.server.checkpoint import (
    INDEX_FILE,
    CheckpointError,
    CheckpointReader,
    write_checkpoint,
)
from expertd.server.synthetic import get_preset, synthetic_layer

PRESET = get_preset("small")  # H=512, I=256, E=64
H, I, E = PRESET.hidden_size, PRESET.intermediate_size, PRESET.num_experts  # noqa: E741 (the protocol's names)
SEED = 11


def name(layer: int, expert: int, proj: str, part: str, prefix: str = "model.") -> str:
    return f"{prefix}layers.{layer}.mlp.experts.{expert}.{proj}.{part}"


def assert_same_layer(got: ShardLayer, want: ShardLayer) -> None:
    """Bit-for-bit equality (fp8 compared as its bytes)."""
    assert got.experts == want.experts and got.num_experts == want.num_experts
    for proj in ("gate", "up", "down"):
        g, w = getattr(got, proj), getattr(want, proj)
        assert torch.equal(g.weight, w.weight), proj
        assert torch.equal(g.weight_scale.view(torch.uint8), w.weight_scale.view(torch.uint8))
        assert g.weight_scale_2.dtype == torch.float32
        assert torch.equal(g.weight_scale_2, w.weight_scale_2), proj
    assert got.norm_weight.dtype == torch.bfloat16
    assert torch.equal(got.norm_weight, want.norm_weight)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "small"
    calls = []
    write_checkpoint(path, PRESET, 2, SEED, progress=lambda *a: calls.append(a))
    return path, calls


@pytest.fixture(scope="module")
def layer0(ckpt):
    """All tensors of layer 0, to rebuild variants of the checkpoint from."""
    return load_file(ckpt[0] / "model-00001-of-00002.safetensors")


def single_file(tmp_path, tensors, config=None):
    """A directory holding one model.safetensors (and config.json if given), no index."""
    tmp_path.mkdir(exist_ok=True)
    save_file(tensors, tmp_path / "model.safetensors")
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_round_trip_is_bit_identical_to_synthetic(ckpt):
    path, calls = ckpt
    files = sorted(p.name for p in path.iterdir())
    assert files == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        INDEX_FILE,
    ]
    index = json.loads((path / INDEX_FILE).read_text())
    assert index["weight_map"][name(1, 63, "down_proj", "weight")] == files[2]
    assert len(index["weight_map"]) == 2 * (E * 9 + 1)
    assert [c[:2] for c in calls] == [(0, 2), (1, 2)]
    assert calls[-1][2] == index["metadata"]["total_size"]

    r = CheckpointReader(path)
    assert (r.layers, r.hidden_size, r.intermediate_size, r.num_experts) == ([0, 1], H, I, E)
    assert r.top_k == PRESET.top_k
    assert r.config["expertd"] == {"preset": "small", "seed": SEED, "prefix": "model."}
    assert "E=64" in r.description
    experts = [5, 0, 63, 17]  # any order: stacked as given
    for layer in (0, 1):
        got = r.load_layer(layer, experts)
        assert_same_layer(got, synthetic_layer(PRESET, SEED, layer, experts))
    # gate and up keep their own global scales.
    assert not torch.equal(got.gate.weight_scale_2, got.up.weight_scale_2)
    assert r.nbytes_for(1, experts) > got.nbytes()


def test_write_refuses_existing_and_leaves_nothing_when_interrupted(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(FileExistsError):
        write_checkpoint(tmp_path / "full", PRESET, 1, SEED)

    def interrupt(layer, layers, nbytes):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path / "new", PRESET, 1, SEED, progress=interrupt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # no partial directory


def test_single_file_and_unindexed_layouts(ckpt, layer0, tmp_path):
    want = synthetic_layer(PRESET, SEED, 0, [3, 9])
    one = single_file(tmp_path / "one", layer0)
    for path in (one, one / "model.safetensors"):
        r = CheckpointReader(path)
        assert r.layers == [0] and r.top_k is None and r.config == {}
        assert_same_layer(r.load_layer(0, [3, 9]), want)

    several = tmp_path / "several"  # the sharded files without their index
    several.mkdir()
    for f in ckpt[0].glob("model-*.safetensors"):
        shutil.copy(f, several)
    r = CheckpointReader(several)
    assert r.layers == [0, 1]
    assert_same_layer(r.load_layer(1, [3, 9]), synthetic_layer(PRESET, SEED, 1, [3, 9]))


def test_reads_only_the_requested_experts(layer0, tmp_path):
    """Experts 40..63 are broken (wrong shape); a shard owning 0..39 loads fine."""
    tensors = dict(layer0)
    for e in range(40, E):
        tensors[name(0, e, "up_proj", "weight")] = torch.zeros(I, H // 4, dtype=torch.uint8)
    r = CheckpointReader(single_file(tmp_path, tensors))
    owned = list(range(40))
    assert_same_layer(r.load_layer(0, owned), synthetic_layer(PRESET, SEED, 0, owned))
    with pytest.raises(CheckpointError, match=r"experts\.41\.up_proj\.weight .*\[256, 128\]"):
        r.load_layer(0, [0, 41])


def test_extra_tensors_ignored_and_scale_2_of_shape_1(layer0, tmp_path):
    tensors = dict(layer0)
    tensors[name(0, 2, "gate_proj", "input_scale")] = torch.tensor(1.0)
    tensors["lm_head.weight"] = torch.zeros(4, 4)
    tensors[name(0, 2, "up_proj", "weight_scale_2")] = torch.tensor([0.125])
    got = CheckpointReader(single_file(tmp_path, tensors)).load_layer(0, [2])
    assert got.up.weight_scale_2.tolist() == [0.125]
    assert got.gate.weight_scale_2.item() == layer0[name(0, 2, "gate_proj", "weight_scale_2")]


def test_custom_prefix(tmp_path):
    prefix = "language_model.model."
    write_checkpoint(tmp_path / "c", PRESET, 1, SEED, prefix=prefix)
    r = CheckpointReader(tmp_path / "c", prefix=prefix)
    assert_same_layer(r.load_layer(0, [1]), synthetic_layer(PRESET, SEED, 0, [1]))
    with pytest.raises(CheckpointError, match=r"prefix 'model\.'"):
        CheckpointReader(tmp_path / "c")


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (
            lambda t: t.pop(name(0, 7, "down_proj", "weight_scale")),
            r"missing tensor model\.layers\.0\.mlp\.experts\.7\.down_proj\.weight_scale .*model\.safetensors",
        ),
        (
            lambda t: t.pop("model.layers.0.mlp.post_expert_norm.weight"),
            r"missing tensor model\.layers\.0\.mlp\.post_expert_norm\.weight",
        ),
        (
            lambda t: t.__setitem__(
                name(0, 7, "gate_proj", "weight_scale"), torch.ones(I, H // 16)
            ),
            r"gate_proj\.weight_scale in model\.safetensors: dtype float32, expected float8_e4m3fn",
        ),
        (
            lambda t: t.__setitem__(
                name(0, 7, "up_proj", "weight_scale_2"), torch.tensor(1.0).double()
            ),
            r"up_proj\.weight_scale_2 .*dtype float64, expected float32",
        ),
        (
            lambda t: t.__setitem__(
                "model.layers.0.mlp.post_expert_norm.weight",
                torch.zeros(H, dtype=torch.bfloat16)[:-1].clone(),
            ),
            r"post_expert_norm\.weight .*shape \[511\], expected \[512\]",
        ),
        (
            lambda t: t.__setitem__(
                name(0, 7, "down_proj", "weight"), torch.zeros(H, I, dtype=torch.uint8)
            ),
            r"experts\.7\.down_proj\.weight .*shape \[512, 256\], expected \[512, 128\]",
        ),
        (
            lambda t: t.__setitem__(name(0, 7, "gate_proj", "weight_scale_2"), torch.ones(2)),
            r"gate_proj\.weight_scale_2 .*shape \[2\], expected \[\] or \[1\]",
        ),
    ],
    ids=["missing", "missing-norm", "dtype", "dtype-scale2", "shape-norm", "shape", "shape-scale2"],
)
def test_bad_tensor_named(layer0, tmp_path, mutate, match):
    tensors = dict(layer0)
    mutate(tensors)
    # The preset (small) has a post-expert norm, so its norm is required.
    r = CheckpointReader(single_file(tmp_path, tensors, {"expertd": {"preset": "small"}}))
    with pytest.raises(CheckpointError, match=match):
        r.load_layer(0, [0, 7])
    if "post_expert_norm" not in match:  # the norm is every shard's; an expert only its owner's
        assert r.load_layer(0, [0, 8]).num_local_experts == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [("hidden_size", 1024), ("moe_intermediate_size", 512), ("num_experts", 32)],
)
def test_config_mismatch_names_field_and_values(layer0, tmp_path, field, value):
    config = {"hidden_size": H, "moe_intermediate_size": I, "num_experts": E, field: value}
    ours = {"hidden_size": H, "moe_intermediate_size": I, "num_experts": E}[field]
    with pytest.raises(CheckpointError, match=rf"{field} = {value}, .* give {ours}"):
        CheckpointReader(single_file(tmp_path, layer0, config))


def test_unknown_layer_and_bad_experts(ckpt):
    r = CheckpointReader(ckpt[0])
    with pytest.raises(CheckpointError, match=r"layer 5 is not in .*layers 0, 1"):
        r.load_layer(5, [0])
    with pytest.raises(CheckpointError, match=r"distinct ids in \[0, 64\)"):
        r.load_layer(0, [64])
    with pytest.raises(ValueError, match="distinct"):  # CheckpointError is a ValueError
        r.load_layer(0, [1, 1])


def test_layers_must_agree(layer0, tmp_path):
    tensors = dict(layer0)
    tensors.update({k.replace("layers.0.", "layers.1."): v.clone() for k, v in layer0.items()})
    for e in range(E):
        tensors[name(1, e, "gate_proj", "weight")] = torch.zeros(I // 2, H // 2, dtype=torch.uint8)
    with pytest.raises(CheckpointError, match=r"layers disagree .*layer 1: H=512 I=128"):
        CheckpointReader(single_file(tmp_path, tensors))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nope")
