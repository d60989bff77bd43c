"""The parts of the product benchmarks that run without a GPU: the clock / power summary a
kernel timing is read with (benchmarks/gpu_clocks.py) and the transport floors of the
serving path (benchmarks/rpc_floor.py: the request steps in Python and real round trips)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_clocks
import rpc_floor


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


def test_rpc_floor_times_the_request_steps_and_real_round_trips():
    steps = rpc_floor.python_steps(2, reps=20)
    assert steps["request_bytes"] > 2 * 2 * 4096  # the two rows' bf16 bytes and more
    assert all(steps[k] > 0 for k in ("parse_us", "validate_us", "pack_us", "encode_us"))
    rpc = rpc_floor.round_trips(bytes(100), bytes(200), reps=20)
    assert set(rpc) == {"echo", "hop", "intercepted"}
    assert all(0 < r["median_us"] <= r["p90_us"] for r in rpc.values())


def test_transport_stage_means_cover_only_the_calls_between_two_snapshots():
    import transport

    before = {"route": {"count": 10, "total_s": 0.001}, "wake": {"count": 2, "total_s": 1e-4}}
    after = {
        "route": {"count": 14, "total_s": 0.0014},
        "wake": {"count": 2, "total_s": 1e-4},  # no call of this stage in between
        "doorbell": {"count": 4, "total_s": 8e-6},  # first seen after the first snapshot
    }
    means = transport.stage_means(before, after)
    assert means.keys() == {"route", "doorbell"}
    assert abs(means["route"] - 100.0) < 1e-6 and abs(means["doorbell"] - 2.0) < 1e-6
