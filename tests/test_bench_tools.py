"""CPU tests of the benchmark helpers whose arithmetic decides kernel changes: the decode cases'
inputs and routing weights (benchmarks/decode_cases.py), the library A/B pairing
(benchmarks/lib_ab.py), the SASS comparison of the libraries a call carries
(benchmarks/carry_libs.py), the bit comparison of their outputs (benchmarks/lib_bits.py) and the
clock / power summary a timing is read with (benchmarks/gpu_clocks.py), the energy A/B's
pairing (benchmarks/energy_ab.py), the energy floor under the power limit
(benchmarks/energy_floor.py), the tile statistics of an input set
(benchmarks/set_spread.py), and the serving path's host-cost probes (benchmarks/rpc_floor.py, benchmarks/runner_latency.py)."""

from __future__ import annotations

import json
import sys
from math import comb
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import carry_libs
import decode_cases
import energy_ab
import energy_floor
import gpu_clocks
import lib_ab
import lib_bits
import rpc_floor
import runner_latency
import set_spread


@pytest.mark.parametrize("m,t", [(1, 0), (1, 1), (1, 3), (1, 8), (2, 5), (4, 32)])
def test_decode_case_hits_t_distinct_local_experts(m, t):
    x, ids, w = decode_cases.case_inputs(m, t, torch.Generator().manual_seed(m * 10 + t), "cpu")
    assert x.shape == (m, 4096) and x.dtype == torch.bfloat16
    assert ids.shape == (m, 8) and w.shape == (m, 8)
    for row in ids.tolist():
        assert len(set(row)) == 8, "a token's 8 ids are distinct"
    local = ids[(ids >= 32) & (ids < 64)]  # shard 1 of 8 owns experts 32-63
    assert local.numel() == t and torch.unique(local).numel() == t
    assert torch.allclose(w.sum(dim=1), torch.ones(m))


def test_decode_case_rejects_impossible_hits():
    with pytest.raises(SystemExit, match="T must be"):
        decode_cases.case_inputs(1, 9, torch.Generator(), "cpu")


def test_m1_expectation_weighs_by_top8_routing():
    rows = [
        {
            "M": 1,
            "local_experts_hit": t,
            "graph_us": 10.0 + t,
            "variants": {"v": {"graph_us": 20.0}},
        }
        for t in range(9)
    ]
    got = decode_cases.m1_expectation(rows, ["v"])
    assert got["probability"] == pytest.approx(1.0)
    p = [comb(32, t) * comb(224, 8 - t) / comb(256, 8) for t in range(9)]
    assert p[0] == pytest.approx(0.3382, abs=1e-4)  # C(224, 8) / C(256, 8)
    assert got["graph_us"]["default"] == pytest.approx(sum(pt * (10 + t) for t, pt in enumerate(p)))
    assert got["graph_us"]["v"] == pytest.approx(20.0)
    assert decode_cases.m1_expectation([{"M": 2, "local_experts_hit": 1}], []) is None


def test_lib_ab_pairs_each_run_with_the_base_of_its_round():
    runs = [
        (0, "old", {1: 10.0, 4: 40.0}),
        (0, "new", {1: 9.0, 4: 44.0}),
        (1, "old", {1: 12.0, 4: 40.0}),
        (1, "new", {1: 9.0, 4: 40.0}),
    ]
    got = lib_ab.pair_ratios(runs, "old")
    assert [(r["round"], r["lib"]) for r in got] == [(0, "new"), (1, "new")]
    assert got[0]["ratio"] == pytest.approx({1: 0.9, 4: 1.1})
    assert got[1]["ratio"] == pytest.approx({1: 0.75, 4: 1.0})


def test_lib_ab_parse_env_reads_switches_and_refuses_a_bare_word():
    assert lib_ab.parse_env("") == {}
    assert lib_ab.parse_env("A=1,B_C=x=y") == {"A": "1", "B_C": "x=y"}
    with pytest.raises(SystemExit, match="expected K=V"):
        lib_ab.parse_env("A=1,oops")


def test_carry_libs_specs():
    assert carry_libs.parse_spec("main=main") == carry_libs.Spec("main", "main", "")
    assert carry_libs.parse_spec("v=@tree:-DEXPERTD_A=1 -DEXPERTD_B=2") == carry_libs.Spec(
        "v", "@tree", "-DEXPERTD_A=1 -DEXPERTD_B=2"
    )
    for bad in ("main", "=main", "a b=main", "x=", "kernels=main", "v=@tree:-O3"):
        with pytest.raises(ValueError):
            carry_libs.parse_spec(bad)


_TABLES = """#define EXPERTD_FOR_EACH_CONFIG(X) \\
  X(16, 1, 4, 4, 4, 6, 1, 2, 4, 4, 6)    \\
  X(32, 1, 4, 2, 2, 5, 1, 4, 2, 2, 5)
#define EXPERTD_FOR_EACH_WG_CONFIG(X) \\
  X(16, 2, 1, 2, 5, 2, 2, 1, 2, 5, 2)   \\
  X(32, 2, 1, 2, 4, 3, 2, 1, 2, 4, 3)   \\
  X(48, 2, 1, 2, 4, 2, 2, 1, 2, 4, 2)
int after;
"""


def test_carry_libs_rows_replace_one_row_of_the_named_table():
    name, table, row = carry_libs.parse_row("b48=wg:X(48, 2, 1, 2, 3, 3, 2, 1, 2, 3, 3)")
    assert (name, table) == ("b48", "wg")
    out = carry_libs.replace_row(_TABLES, table, row)
    assert "  X(48, 2, 1, 2, 3, 3, 2, 1, 2, 3, 3)\n" in out
    assert (
        out.replace("X(48, 2, 1, 2, 3, 3, 2, 1, 2, 3, 3)", "X(48, 2, 1, 2, 4, 2, 2, 1, 2, 4, 2)")
        == _TABLES
    )
    # BT 16 is in both tables: only the named one changes, continuation backslashes kept
    out = carry_libs.replace_row(_TABLES, "v6", "X(16, 1, 2, 4, 4, 6, 1, 2, 4, 4, 6)")
    assert "  X(16, 1, 2, 4, 4, 6, 1, 2, 4, 4, 6)    \\\n" in out
    assert "  X(16, 2, 1, 2, 5, 2, 2, 1, 2, 5, 2)   \\\n" in out
    with pytest.raises(ValueError, match="no row for tile size 64"):
        carry_libs.replace_row(_TABLES, "wg", "X(64, 2, 1, 2, 4, 2, 2, 1, 2, 4, 2)")
    with pytest.raises(ValueError, match="no row for tile size 48"):
        carry_libs.replace_row(_TABLES, "v6", "X(48, 1, 4, 2, 2, 5, 1, 4, 2, 2, 5)")
    for bad in ("b48=X(48, 2)", "b48=v7:X(48, 2, 1, 2, 3, 3, 2, 1, 2, 3, 3)", "b48=wg:X(48, 2, 1)"):
        with pytest.raises(ValueError):
            carry_libs.parse_row(bad)


def test_carry_libs_rows_fit_the_real_kernel_source():
    path = carry_libs.ROOT / carry_libs.KERNEL_SOURCE
    text = path.read_text()
    for table, row in (
        ("wg", "X(48, 2, 1, 2, 3, 3, 2, 1, 2, 3, 3)"),
        ("v6", "X(8, 1, 1, 4, 8, 3, 1, 2, 2, 8, 3)"),
    ):
        out = carry_libs.replace_row(text, table, row)
        changed = [
            (a, b) for a, b in zip(text.splitlines(), out.splitlines(), strict=True) if a != b
        ]
        assert len(changed) == 1 and row in changed[0][1], (table, changed)


_SASS = """
        Function : _ZN45_GLOBAL__N__%s_12_moe_nvfp4_cu_2513521512route_kernelEv
        /*0000*/                   LDC R1, c[0x0][0x28] ;   /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;       /* 0x0000000000007919 */
        Function : _ZN45_GLOBAL__N__%s_12_moe_nvfp4_cu_2513521515finalize_kernelEv
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   %s ;
"""


def test_carry_libs_sass_compare_ignores_the_build_hash_and_addresses():
    a = carry_libs.sass_functions(_SASS % ("e090844d", "e090844d", "EXIT"))
    b = carry_libs.sass_functions(_SASS % ("0badf00d", "0badf00d", "BRA 0x10"))
    assert set(a) == set(b) and len(a) == 2
    route = next(f for f in a if "route_kernel" in f)
    assert a[route] == ["LDC R1, c[0x0][0x28]", "S2R R0, SR_TID.X"]
    c = carry_libs.compare(a, b)
    assert [carry_libs.short(f) for f in c["same"]] == ["route_kernelEv"]
    assert [carry_libs.short(f) for f in c["differ"]] == ["finalize_kernelEv"]
    c = carry_libs.compare(a, {route: a[route]})
    assert len(c["only_base"]) == 1 and not c["only_other"]


def test_lib_bits_compare_is_bitwise():
    a = torch.tensor([[1.0, -0.0, 2.5]], dtype=torch.bfloat16)
    saved = {"same": a, "sign of zero": a, "value": a, "gone": a}
    now = {
        "same": a.clone(),
        "sign of zero": torch.tensor([[1.0, 0.0, 2.5]], dtype=torch.bfloat16),  # == as floats
        "value": torch.tensor([[1.0, -0.0, 2.0]], dtype=torch.bfloat16),
    }
    lines = lib_bits.compare(saved, now)
    assert lines[0] == "same same"
    assert lines[1].startswith("DIFF sign of zero: 1 elements differ")
    assert lines[2] == "DIFF value: 1 elements differ, largest difference 0.5"
    assert lines[3] == "DIFF gone: missing or another shape"


def test_clock_window_summarizes_only_its_samples():
    # nvidia-smi rows: clocks.sm, clocks.mem, power.draw, temperature.gpu, event reasons (hex)
    smp = object.__new__(gpu_clocks.Sampler)
    smp.samples = [
        (0.5, ["1980", "3201", "120.5", "37", "0x0000000000000001"]),
        (1.0, ["1600", "3201", "694.0", "55", "0x0000000000000004"]),
        (1.1, ["1500", "3201", "[N/A]", "56", "0x0000000000000004"]),
        (1.2, ["1700", "3201", "690.0", "56", "0x0000000000000000"]),
        (2.0, ["1980", "3201", "130.0", "40", "0x0000000000000001"]),
    ]
    w = smp.window(0.9, 1.5)
    assert w["samples"] == 3
    assert w["sm_mhz_median"] == 1600 and w["sm_mhz_min"] == 1500
    assert w["power_w_median"] == 694.0  # the unreadable power sample is skipped
    assert w["reasons"] == ["sw_power_cap"] and w["reasons_mask"] == "0x4"
    assert smp.window(3.0, 4.0) == {"samples": 0}


def test_energy_ab_alternates_and_reads_the_default_rows():
    libs = [("a", "x"), ("b", "y")]
    assert energy_ab.round_order(libs, 0) == libs
    assert energy_ab.round_order(libs, 1) == libs[::-1]
    rows = [
        {"case": "idle", "watts": 121.0},
        {"case": "M=512", "m": 512, "env": {}, "mj_per_call": 225.0, "us_per_call": 324.0},
        {"case": "M=512 X=1", "m": 512, "env": {"X": "1"}, "mj_per_call": 1.0, "us_per_call": 1.0},
        {"case": "M=1024", "m": 1024, "env": {}, "mj_per_call": 295.0, "us_per_call": 425.0},
    ]
    assert energy_ab.per_m(rows) == {
        512: {"mj": 225.0, "us": 324.0},
        1024: {"mj": 295.0, "us": 425.0},
    }


def test_lib_specs_need_a_name_and_an_existing_file(tmp_path):
    lib = tmp_path / "libexpertd_kernels.so"
    lib.write_bytes(b"")
    assert lib_ab.parse_libs([f"new={lib}"]) == [("new", str(lib))]
    with pytest.raises(SystemExit, match="existing library"):
        lib_ab.parse_libs([f"old={tmp_path / 'missing.so'}"])
    with pytest.raises(SystemExit, match="NAME=path"):
        lib_ab.parse_libs([str(lib)])


def test_set_stats_counts_routes_tiles_and_padding():
    # global ids 32..63 are local slots 0..31 (the benchmark's shard); 255 is not local
    local_of = torch.full((257,), -1, dtype=torch.long)
    local_of[32:64] = torch.arange(32)
    # slot 0: 40 routes, slot 1: 17, slot 2: 1; every row also routes to a non-local id
    rows = [[32, 255]] * 40 + [[33, 255]] * 17 + [[34, 255]]
    ids = torch.tensor(rows, dtype=torch.int32)
    st = set_spread.set_stats(ids, local_of, bt=16)
    assert st["local_routes"] == 58 and st["max_routes"] == 40 and st["min_routes"] == 0
    # tiles at BT 16: 40 -> 16, 16, 8; 17 -> 16, 1; 1 -> 1
    assert st["tiles"] == 6
    assert st["padding_rows"] == 6 * 16 - 58
    assert st["tile_rows_le_half"] == 3  # the tiles of 8, 1 and 1 rows
    assert st["tile_rows_le_2_3"] == 3  # <= 10 rows: the same three


def test_rpc_floor_times_the_request_steps_and_real_round_trips():
    steps = rpc_floor.python_steps(2, reps=20)
    assert steps["request_bytes"] > 2 * 2 * 4096  # the two rows' bf16 bytes and more
    assert all(steps[k] > 0 for k in ("parse_us", "validate_us", "pack_us", "encode_us"))
    rpc = rpc_floor.round_trips(bytes(100), bytes(200), reps=20)
    assert set(rpc) == {"echo", "hop", "intercepted"}
    assert all(0 < r["median_us"] <= r["p90_us"] for r in rpc.values())


def test_runner_latency_on_cpu_writes_its_rows(tmp_path, monkeypatch):
    argv = ["runner_latency.py", "--out", str(tmp_path), "--preset", "small", "--ms", "1,3"]
    monkeypatch.setattr(sys, "argv", [*argv, "--reps", "5", "--device", "cpu"])
    assert runner_latency.main() == 0
    (written,) = tmp_path.glob("runner-latency-cpu-*.json")
    rows = json.loads(written.read_text())["rows"]
    assert [r["M"] for r in rows] == [1, 3]
    assert all(r["launch"]["median"] > 0 and r["run"]["median"] > 0 for r in rows)


def test_energy_floor_adds_read_and_mma_energy_over_the_budget():
    rates = {
        "copy_Bps": 4e12,
        "matmul_flops": 5e14,
        "j_per_byte": 50e-12,
        "j_per_flop": 1e-12,
        "budget_w": 500.0,
    }
    r = energy_floor.energy_row(1024, nbytes=8e8, flops=1e11, rates=rates)
    assert r["floor_us"] == pytest.approx(200.0)  # bytes and flops both take 200 us
    assert r["read_mj"] == pytest.approx(40.0) and r["mma_mj"] == pytest.approx(100.0)
    assert r["t_energy_us"] == pytest.approx(280.0)  # 140 mJ / 500 W
    assert r["t_energy_x_floor"] == pytest.approx(1.4)
    assert r["target_x"] == 1.25 and r["target_us"] == pytest.approx(250.0)
    assert r["left_mj"] == pytest.approx(-15.0)  # the target is 30 us of budget short
    assert energy_floor.target(1) == 2.0 and energy_floor.target(2048) == 1.5
    small = energy_floor.energy_row(16, nbytes=8e8, flops=1e9, rates=rates)
    assert small["floor_us"] == pytest.approx(200.0) and small["left_mj"] > 0
