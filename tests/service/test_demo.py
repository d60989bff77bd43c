"""`expertd demo`, the README's main job, end to end (small: 2 shards, 2 batch sizes)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_runs_and_checks_every_result(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "expertd", "demo", "--shards", "2", "--device", "cpu",
         "--batch-sizes", "1,33", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "EXPERTD_CACHE_DIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all results correct" in done.stdout and "servers stopped cleanly" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.strip().endswith("| ok")]
    assert len(rows) == 2
