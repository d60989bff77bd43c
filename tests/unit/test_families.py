"""Model families (server/families.py, docs/models.md): the expert configuration read from a
config, the refusals that name their field, the per-family tensor layouts the reader loads,
and the expert math of a layer without a post-expert norm."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from expertd.kernels.reference import reference_forward, relative_error
from expertd.server.checkpoint import CheckpointError, CheckpointReader, write_checkpoint
from expertd.server.families import ConfigError, expert_config
from expertd.server.synthetic import PRESETS, Preset, get_preset, synthetic_layer

# A small shape of a family without a post-expert norm: H = 256, I = 128, E = 8, top-2.
TINY = Preset("tiny", 256, 128, 8, 2)
SEED = 5

QWEN3_30B = {  # the hub's Qwen/Qwen3-30B-A3B config.json, the fields that matter
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"},
}
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}


def test_family_configs():
    q = expert_config(QWEN3_30B)
    assert (q.hidden_size, q.intermediate_size, q.num_experts, q.top_k) == (2048, 768, 128, 8)
    assert (q.family, q.norm_topk_prob, q.routed_scaling_factor) == ("qwen3-moe", True, 1.0)
    # transformers 5 writes the Qwen3-MoE expert count as num_local_experts.
    renamed = {k: v for k, v in QWEN3_30B.items() if k != "num_experts"}
    assert expert_config({**renamed, "num_local_experts": 128}).num_experts == 128
    d = expert_config(DEEPSEEK_V3)
    assert (d.hidden_size, d.intermediate_size, d.num_experts, d.top_k) == (7168, 2048, 256, 8)
    assert (d.family, d.routed_scaling_factor, d.quant_algo) == ("deepseek-v3", 2.5, "NVFP4")
    m = expert_config(MIXTRAL)  # Mixtral's expert width is its intermediate_size
    assert (m.hidden_size, m.intermediate_size, m.num_experts, m.top_k) == (4096, 14336, 8, 2)
    assert m.family == "mixtral" and m.norm_topk_prob is None
    # Multimodal configs keep the language model under text_config.
    nested = expert_config({"architectures": ["X"], "text_config": QWEN3_30B})
    assert (nested.hidden_size, nested.num_experts) == (2048, 128)


def test_presets_name_the_released_shapes():
    shapes = {
        name: (p.hidden_size, p.intermediate_size, p.num_experts, p.top_k, p.post_norm)
        for name, p in PRESETS.items()
    }
    assert shapes["deepseek-v3"] == (7168, 2048, 256, 8, False)
    assert shapes["qwen3-235b-a22b"] == (4096, 1536, 128, 8, False)
    assert shapes["qwen3-30b-a3b"] == (2048, 768, 128, 8, False)
    assert shapes["muse-spark"] == (4096, 4096, 256, 8, True)
    assert shapes["llama4-scout"] == (5120, 8192, 16, 1, False)
    assert shapes["llama4-maverick"] == (5120, 8192, 128, 1, False)
    for p in PRESETS.values():  # every preset is legal for the CUDA kernel
        assert p.hidden_size % 256 == 0 and p.intermediate_size % 256 == 0, p.name
    q = expert_config(QWEN3_30B)
    p = get_preset("qwen3-30b-a3b")
    assert (q.hidden_size, q.intermediate_size, q.num_experts, q.top_k) == (
        p.hidden_size,
        p.intermediate_size,
        p.num_experts,
        p.top_k,
    )


@pytest.mark.parametrize(
    ("change", "quant", "match"),
    [
        ({"hidden_act": "gelu"}, None, r"hidden_act = 'gelu' is not supported"),
        ({"num_experts_per_tok": 200}, None, r"num_experts_per_tok = 200 exceeds the 128"),
        ({"hidden_size": 2050}, None, r"hidden_size = 2050 is not a multiple of 16"),
        ({"moe_intermediate_size": 0}, None, r"moe_intermediate_size = 0, expected a positive"),
        ({"routed_scaling_factor": "x"}, None, r"routed_scaling_factor = 'x', expected a number"),
        (
            {},
            {"quantization": {"quant_algo": "FP8", "group_size": 16}},
            r"hf_quant_config\.json: quantization\.quant_algo = 'FP8' is not supported",
        ),
        (
            {},
            {"quantization": {"quant_algo": "NVFP4", "group_size": 32}},
            r"quantization\.group_size = 32",
        ),
        (
            {"quantization_config": {"quant_method": "gptq", "bits": 4}},
            None,
            r"config\.json: quantization_config\.quant_method = 'gptq'",
        ),
        (
            {"quantization_config": {"quant_method": "modelopt", "quant_algo": "MXFP4"}},
            None,
            r"quantization_config\.quant_algo = 'MXFP4'",
        ),
    ],
    ids=["act", "top_k", "h", "i", "scaling", "algo", "group", "method", "algo-config"],
)
def test_unsupported_settings_refused_naming_the_field(change, quant, match):
    with pytest.raises(ConfigError, match=match):
        expert_config({**QWEN3_30B, **change}, quant)


def tiny_tensors(layout: str, layers=(0,), prefix: str = "model.") -> dict[str, torch.Tensor]:
    """TINY's synthetic experts under a family's names."""
    block, names = {
        "mlp": ("mlp", ("gate_proj", "up_proj", "down_proj")),
        "block_sparse_moe": ("block_sparse_moe", ("w1", "w3", "w2")),
    }[layout]
    tensors = {}
    for layer in layers:
        full = synthetic_layer(TINY, SEED, layer, list(range(TINY.num_experts)))
        for proj, name in zip((full.gate, full.up, full.down), names, strict=True):
            for e in range(TINY.num_experts):
                base = f"{prefix}layers.{layer}.{block}.experts.{e}.{name}"
                tensors[f"{base}.weight"] = proj.weight[e].clone()
                tensors[f"{base}.weight_scale"] = proj.weight_scale[e].clone()
                tensors[f"{base}.weight_scale_2"] = proj.weight_scale_2[e].clone()
                tensors[f"{base}.input_scale"] = torch.tensor(0.5)
    return tensors


def save(tmp_path, tensors, config=None, quant=None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, tmp_path / "model.safetensors")
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    if quant is not None:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(quant))
    return tmp_path


def assert_same(got, want):
    for proj in ("gate", "up", "down"):
        g, w = getattr(got, proj), getattr(want, proj)
        assert torch.equal(g.weight, w.weight), proj
        assert torch.equal(g.weight_scale.view(torch.uint8), w.weight_scale.view(torch.uint8))
        assert torch.equal(g.weight_scale_2, w.weight_scale_2), proj


def test_mixtral_layout(tmp_path):
    """w1 is gate, w3 up, w2 down; no post-expert norm; input scales ignored."""
    config = {**MIXTRAL, "hidden_size": 256, "intermediate_size": 128, "num_local_experts": 8}
    r = CheckpointReader(save(tmp_path, tiny_tensors("block_sparse_moe"), config))
    assert r.layout.block == "block_sparse_moe" and not r.post_norm and r.top_k == 2
    got = r.load_layer(0, [6, 1])
    assert got.norm_weight is None
    assert_same(got, synthetic_layer(TINY, SEED, 0, [6, 1]))
    assert "family=mixtral" in r.description


def test_deepseek_layout_skips_dense_layers_and_shared_experts(tmp_path):
    tensors = tiny_tensors("mlp", layers=(1, 2))
    # Layer 0 is dense; every layer has the router, its bias and a shared expert (bf16 here).
    tensors["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(128, 256, dtype=torch.bfloat16)
    for layer in (1, 2):
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = torch.zeros(8, 256)
        tensors[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] = torch.zeros(8)
        tensors[f"model.layers.{layer}.mlp.shared_experts.gate_proj.weight"] = torch.zeros(
            128, 128, dtype=torch.uint8
        )
    config = {**DEEPSEEK_V3, "hidden_size": 256, "moe_intermediate_size": 128}
    config.update(n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1)
    r = CheckpointReader(save(tmp_path, tensors, config))
    assert r.layers == [1, 2] and r.num_experts == 8 and not r.post_norm
    assert r.expert_config.routed_scaling_factor == 2.5
    assert_same(r.load_layer(2, [0, 7]), synthetic_layer(TINY, SEED, 2, [0, 7]))


def test_family_layout_must_match_its_architecture(tmp_path):
    config = {**QWEN3_30B, "hidden_size": 256, "moe_intermediate_size": 128, "num_experts": 8}
    with pytest.raises(
        CheckpointError, match=r"'Qwen3MoeForCausalLM' keeps its experts under 'mlp'"
    ):
        CheckpointReader(save(tmp_path, tiny_tensors("block_sparse_moe"), config))


def test_fused_layout_with_a_wrong_shape_is_refused_naming_the_tensor(tmp_path):
    tensors = {
        "model.layers.0.feed_forward.experts.gate_up_proj": torch.zeros(128, 256, dtype=torch.uint8)
    }
    with pytest.raises(CheckpointError, match=r"feed_forward\.experts\.gate_up_proj: shape \[128, 256\], expected \[E, H/2, 2I\]"):  # fmt: skip
        CheckpointReader(save(tmp_path, tensors))


def test_fused_layout_under_another_prefix_names_it(tmp_path):
    tensors = {
        "language_model.model.layers.0.feed_forward.experts.gate_up_proj": torch.zeros(
            8, 128, 256, dtype=torch.uint8
        )
    }
    with pytest.raises(CheckpointError, match=r"under the prefix 'language_model\.model\.'"):
        CheckpointReader(save(tmp_path, tensors))


def test_wrong_prefix_names_the_right_one(tmp_path):
    tensors = tiny_tensors("mlp", prefix="language_model.model.")
    with pytest.raises(CheckpointError, match=r"under the prefix 'language_model\.model\.'"):
        CheckpointReader(save(tmp_path, tensors))
    r = CheckpointReader(tmp_path, prefix="language_model.model.")
    assert_same(r.load_layer(0, [3]), synthetic_layer(TINY, SEED, 0, [3]))


def test_unquantized_expert_names_the_exclude_pattern(tmp_path):
    tensors = tiny_tensors("mlp")
    tensors["model.layers.0.mlp.experts.3.down_proj.weight"] = torch.zeros(
        256, 128, dtype=torch.bfloat16
    )
    quant = {"quantization": {"quant_algo": "NVFP4", "group_size": 16,
                              "exclude_modules": ["lm_head", "model.layers.0.mlp.experts.3.*"]}}  # fmt: skip
    r = CheckpointReader(save(tmp_path, tensors, quant=quant))
    with pytest.raises(CheckpointError, match=r"down_proj\.weight .*dtype bfloat16.*exclude_modules 'model\.layers\.0\.mlp\.experts\.3\.\*'"):  # fmt: skip
        r.load_layer(0, [3])
    assert r.load_layer(0, [2, 4]).num_local_experts == 2  # other experts load


def test_unsupported_quantization_refused_at_open(tmp_path):
    quant = {"quantization": {"quant_algo": "W4A8_AWQ", "group_size": 128}}
    with pytest.raises(CheckpointError, match=r"quant_algo = 'W4A8_AWQ'"):
        CheckpointReader(save(tmp_path, tiny_tensors("mlp"), quant=quant))


def test_writer_of_a_family_preset_has_no_norm(tmp_path):
    write_checkpoint(tmp_path / "c", TINY, 1, SEED)
    r = CheckpointReader(tmp_path / "c")
    assert not r.post_norm
    assert not [n for n in r._entries if "post_expert_norm" in n]
    got = r.load_layer(0, [0, 5])
    assert got.norm_weight is None
    assert_same(got, synthetic_layer(TINY, SEED, 0, [0, 5]))


def test_forward_without_post_expert_norm_is_the_weighted_sum_of_experts():
    """Qwen3-MoE, DeepSeek-V3, Mixtral: out[t] = sum_j w_j * W2 (silu(G x) * (U x))."""
    layer = synthetic_layer(TINY, SEED, 0, list(range(8)))
    assert layer.norm_weight is None
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 256, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(5)]).int()
    ids[4, 1] = -1  # no route
    w = torch.rand(5, 2, generator=gen)
    gate, up, down = (p.dequantize(torch.float64) for p in (layer.gate, layer.up, layer.down))
    want = torch.zeros(5, 256, dtype=torch.float64)
    for t in range(5):
        for j in range(2):
            e = ids[t, j].item()
            if e >= 0:
                xe = x[t].double()
                a = torch.nn.functional.silu(gate[e] @ xe) * (up[e] @ xe)
                want[t] += w[t, j].double() * (down[e] @ a)
    got = reference_forward(layer, x, ids, w)
    assert relative_error(got, want) < 1e-12
    # The same weights with a norm of zeros are not the same layer: the norm rescales.
    normed = type(layer)(*[getattr(layer, f) for f in ("experts", "num_experts", "gate", "up", "down")],
                         norm_weight=torch.zeros(256, dtype=torch.bfloat16))  # fmt: skip
    assert relative_error(reference_forward(normed, x, ids, w), want) > 0.1


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_modelopt_export_decodes_to_the_models_bf16_weights():
    """The committed ModelOpt export (scripts/make_qwen3_moe_fixture.py), read by expertd, is
    the model it was made from: kept rows of its bf16 expert weights within NVFP4's rounding
    (~0.1 relative; a wrong nibble order, sign bit or gate/up placement gives ~1.4)."""
    reader = CheckpointReader(FIXTURES / "qwen3-moe-tiny")
    rows = load_file(FIXTURES / "qwen3-moe-tiny-bf16-rows.safetensors")
    assert len(rows) == 9
    for name, want in rows.items():
        layer, expert, proj = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)_proj", name).groups()  # fmt: skip
        got = getattr(reader.load_layer(int(layer), [int(expert)]), proj).dequantize()[0]
        err = relative_error(got[: want.shape[0]], want.float())
        assert 0.02 < err < 0.15, f"{name}: {err:.3f}"
    # E2M1 -0 (sign bit, zero magnitude) occurs in the export and decodes to zero.
    codes = reader.load_layer(0, [0]).gate.weight
    assert ((codes & 0x0F) == 0x08).any() or ((codes >> 4) == 0x08).any()


def test_llama4_fused_export_decodes_to_the_models_bf16_weights():
    """Llama-4's fused layout as ModelOpt exports it (scripts/make_llama4_fixture.py): every
    expert of a layer in one gate_up and one down tensor, packed along the input dimension.
    Each expert read by expertd is the model's bf16 weights within NVFP4's rounding on the
    kept input rows (a transposed slice, a swapped gate and up or a wrong nibble gives
    ~1.4), in any subset and order of experts; only the owned experts' bytes are read."""
    reader = CheckpointReader(FIXTURES / "llama4-tiny")
    assert reader.expert_config.family == "llama-4" and reader.top_k == 1
    assert (reader.hidden_size, reader.intermediate_size, reader.num_experts) == (256, 256, 4)
    rows = load_file(FIXTURES / "llama4-tiny-bf16-rows.safetensors")
    gate_up = rows["model.layers.0.feed_forward.experts.gate_up_proj"].float()  # [E, 16, 2I]
    down = rows["model.layers.0.feed_forward.experts.down_proj"].float()  # [E, 16, H]
    n = gate_up.shape[1]
    layer = reader.load_layer(0, [3, 0, 2])
    assert layer.experts == (3, 0, 2)
    for slot, e in enumerate(layer.experts):
        for got, want in (
            (layer.gate.dequantize()[slot][:, :n], gate_up[e, :, :256].T),
            (layer.up.dequantize()[slot][:, :n], gate_up[e, :, 256:].T),
            (layer.down.dequantize()[slot][:, :n], down[e].T),
        ):
            err = relative_error(got, want)
            assert 0.02 < err < 0.15, f"expert {e}: {err:.3f}"
    one = reader.load_layer(0, [2])
    assert torch.equal(one.down.weight[0], layer.down.weight[2])
    # half the experts, half the bytes, but for the two global scales (4 bytes each)
    assert reader.nbytes_for(0, [1, 2]) * 2 - 8 == reader.nbytes_for(0, [0, 1, 2, 3])
