"""GPU test of the timeline instrument (benchmarks/timeline.py, the -DEXPERTD_TIMELINE library):
its events obey the order programmatic dependent launch guarantees. Skipped without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[1]


def test_timeline_events_follow_the_launch_order(tmp_path):
    cmd = [sys.executable, "benchmarks/timeline.py", "--ms", "1,300", "--reps", "3"]
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "EXPERTD_KERNEL_TIMELINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (path,) = tmp_path.glob("timeline-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["M"] for r in rows] == [1, 300]
    for r in rows:
        ev = r["events"]
        assert ev["route"]["entry"][0] == 0.0  # the reference point
        for k in ("gemm1", "gemm2"):  # one local route per token at least: real GEMM blocks
            e = ev[k]
            assert e["entry"][0] <= e["waited"][0] <= e["loop_done"][0] <= e["done"][1]
        # griddepcontrol.wait returns only once the previous kernel has completed
        assert ev["gemm1"]["waited"][0] >= ev["route"]["done"][1]
        assert ev["gemm2"]["waited"][0] >= ev["gemm1"]["done"][1]
        assert ev["finalize"]["waited"][0] >= ev["gemm2"]["done"][1]
        assert ev["finalize"]["done"][1] >= ev["finalize"]["waited"][0]
