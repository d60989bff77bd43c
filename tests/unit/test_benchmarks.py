"""The parts of the product benchmarks that run without a GPU: the clock / power summary a
kernel timing is read with (benchmarks/gpu_clocks.py), the transport floors of the
serving path (benchmarks/rpc_floor.py: the request steps in Python and real round trips),
and the transport benchmark's stage means and MPS daemon (benchmarks/transport.py)."""

from __future__ import annotations

import os
import sys
import time
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


_FAKE_MPS_CONTROL = """#!/bin/sh
# Stands in for nvidia-cuda-mps-control: -d makes the control pipe in the pipe directory
# the environment names, `quit` on stdin removes it; each call is logged beside it.
echo "$* $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> "$MPS_CALLS"
if [ "$1" = "-d" ]; then
  [ -n "$MPS_FAIL" ] && { echo "cannot start" >&2; exit 1; }
  mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"
else
  read cmd
  [ "$cmd" = quit ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
fi
"""


def test_transport_mps_daemon_names_its_directories_to_the_run_and_stops(tmp_path, monkeypatch):
    import transport

    from expertd import cudamem

    tool = tmp_path / "bin" / "nvidia-cuda-mps-control"
    tool.parent.mkdir()
    tool.write_text(_FAKE_MPS_CONTROL)
    tool.chmod(0o755)
    calls = tmp_path / "calls"
    monkeypatch.setenv("PATH", f"{tool.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("MPS_CALLS", str(calls))
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/the/operators/own")
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    with transport.mps_daemon():
        pipe_dir = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
        assert pipe_dir != "/the/operators/own"
        assert cudamem.mps_control_pipe() == f"{pipe_dir}/control"  # what a shard would see
    assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == "/the/operators/own"  # restored
    assert "CUDA_MPS_LOG_DIRECTORY" not in os.environ
    deadline = time.monotonic() + 10  # quit and the clean-up run detached, after the run
    while Path(pipe_dir).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not Path(pipe_dir).exists()  # the run's directories are gone
    started, stopped = calls.read_text().splitlines()
    assert started.startswith(f"-d {pipe_dir} ") and stopped.startswith(f" {pipe_dir} ")

    monkeypatch.setenv("MPS_FAIL", "1")
    try:
        with transport.mps_daemon():
            raise AssertionError("a daemon that failed to start must not run the body")
    except RuntimeError as e:
        assert "cannot start" in str(e)
    assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == "/the/operators/own"

    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    try:
        with transport.mps_daemon():
            raise AssertionError("no tool, no run")
    except RuntimeError as e:
        assert "not on PATH" in str(e)


def test_mps_control_pipe_is_found_where_the_driver_looks(tmp_path, monkeypatch):
    from expertd import cudamem

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert cudamem.mps_control_pipe() is None
    os.mkfifo(tmp_path / "control")
    assert cudamem.mps_control_pipe() == str(tmp_path / "control")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY")
    expected = "/tmp/nvidia-mps/control"
    assert cudamem.mps_control_pipe() == (expected if os.path.exists(expected) else None)


def test_transport_grpc_echo_held_for_a_forward_takes_the_hold_off():
    """The held echo floor (benchmarks/transport.py): its server keeps its loop busy for
    hold_us before each answer and the round trips come back with that taken off; the
    server is a spawned process, so it also runs after this process has used gRPC."""
    import transport

    plain = transport.grpc_echo_us(100, 200, reps=20)
    held = transport.grpc_echo_us(100, 200, reps=20, hold_us=3000.0)
    assert len(plain) == len(held) == 20 and min(plain) > 0
    assert min(held) > 0  # each round trip lasted at least the hold
    assert sorted(held)[10] < 3000.0  # and the hold was taken off
    start = time.perf_counter()
    transport._hold(0.002)
    assert 0.002 <= time.perf_counter() - start < 0.02
