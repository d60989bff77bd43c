"""examples/tiny_moe.py runs as documented: a tiny MoE model whose layers run
through RemoteExperts on real local shards matches the local reference, also
after one replica is stopped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe.py"


def test_tiny_moe_example_matches_local_reference():
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "replica a stopped" in done.stdout and "ok: tolerance" in done.stdout
