"""The README's quick start, run as written, so it cannot drift from the code.

The bash block's `expertd cluster` command runs for real (on free ports instead of
the README's), the python block runs against it in its own process, and the line
it prints is checked against the README's output block. Then the cluster gets the
Ctrl-C the README tells the reader to send, and must drain and exit cleanly.
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
TOLERANCE = 1e-2  # docs/protocol.md: relative Frobenius error
WAIT_S = 900  # loading two shards on a busy 2-core machine; a bound, not a speed check


def quick_start() -> tuple[str, str, str]:
    """The section's bash, python and output blocks (exactly one of each)."""
    text = README.read_text()
    assert "\n## Quick start\n" in text, "README.md has no '## Quick start' section"
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w*)\n(.*?)```", section, re.S)
    by_lang: dict[str, list[str]] = {}
    for lang, body in blocks:
        by_lang.setdefault(lang, []).append(body)
    assert {k: len(v) for k, v in by_lang.items()} == {"bash": 1, "python": 1, "": 1}, by_lang
    return by_lang["bash"][0], by_lang["python"][0], by_lang[""][0]


def free_port_pair() -> int:
    """A port p with p and p + 1 both free (the cluster listens on base + shard)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base >= 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def expertd_command(args: list[str]) -> list[str]:
    script = Path(sys.executable).with_name("expertd")  # the console script, as typed
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "expertd", *args]


def test_quick_start_runs_as_written(tmp_path):
    bash, code, expected = quick_start()
    lines = [line.strip() for line in bash.splitlines() if line.strip()]
    assert lines[0] == "source .venv/bin/activate"  # the environment this test runs in
    assert len(lines) == 2 and lines[1].startswith("expertd cluster "), lines
    args = shlex.split(lines[1])[1:]
    readme_base = int(args[args.index("--base-port") + 1])
    readme_addresses = [f"127.0.0.1:{readme_base}", f"127.0.0.1:{readme_base + 1}"]
    assert all(a in code for a in readme_addresses), "the python block calls other addresses"

    base = free_port_pair()
    args[args.index("--base-port") + 1] = str(base)
    addresses = [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]
    for ours, theirs in zip(addresses, readme_addresses, strict=True):
        code = code.replace(theirs, ours)

    log = (tmp_path / "cluster.log").open("w")
    cluster = subprocess.Popen(
        expertd_command(args),
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        cwd=tmp_path,
        start_new_session=True,  # its shard processes too, for the cleanup below
    )
    lines_out: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in cluster.stdout:
            lines_out.put(line)

    threading.Thread(target=pump, daemon=True).start()
    try:
        said = []
        while "SERVING" not in said:
            try:
                said.append(lines_out.get(timeout=WAIT_S).strip())
            except queue.Empty:
                raise AssertionError(f"cluster not SERVING: {said}") from None
            assert cluster.poll() is None, (said, (tmp_path / "cluster.log").read_text())
        assert f"ADDRESSES {','.join(addresses)}" in said

        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=WAIT_S,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        printed = done.stdout.strip().splitlines()[-1]

        want = re.fullmatch(r"(.*) relative error (\S+)", expected.strip())
        got = re.fullmatch(r"(.*) relative error (\S+)", printed)
        assert want and got, (expected, printed)
        assert got.group(1) == want.group(1), (printed, expected)
        assert 0 < float(got.group(2)) <= TOLERANCE, printed
        assert float(want.group(2)) <= TOLERANCE, "the README shows an error above tolerance"

        cluster.send_signal(signal.SIGINT)  # the README's Ctrl-C
        assert cluster.wait(timeout=WAIT_S) == 0, (tmp_path / "cluster.log").read_text()
    finally:
        if cluster.poll() is None:
            os.killpg(cluster.pid, signal.SIGKILL)
            cluster.wait()
        log.close()
