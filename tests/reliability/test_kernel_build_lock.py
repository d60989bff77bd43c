"""The kernel build under contention, with real processes: builders that start together
compile once (the others wait on the lock and load the first one's library), a library
appears only whole (one rename), and a builder killed mid-compile leaves nothing that is
loaded and does not block the next.

The processes run the real kernels/build.py (loaded by path: it imports nothing of expertd)
on a tiny source. Most tests use a stand-in compiler that waits for the test's go-ahead, so
the order of events is fixed, not timed; one test compiles with the real nvcc and skips
without it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from expertd.kernels import build

TINY = 'extern "C" int expertd_tiny_answer() { return 42; }\n'
STARTED: list[subprocess.Popen] = []
WAIT_S = 120  # generous: a hung test fails after this, a quick one never waits it

# A stand-in nvcc: prints a version; to compile, records the call, says it started, waits
# for the go file, then writes its output (or hands the call to REAL_NVCC when set).
FAKE_NVCC = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 13.0 (test)"; exit 0; fi
echo $$ >> "$FAKE_DIR/calls"
touch "$FAKE_DIR/started.$$"
if [ -n "$REAL_NVCC" ]; then exec "$REAL_NVCC" "$@"; fi
n=0
while [ ! -e "$FAKE_DIR/go" ]; do sleep 0.05; n=$((n+1)); [ $n -gt 2400 ] && exit 3; done
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
printf 'built by %s\\n' $$ > "$out"
"""

DRIVER = """import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("kbuild", sys.argv[1])
b = importlib.util.module_from_spec(spec)
spec.loader.exec_module(b)
b.CSRC, b.SOURCES, b.HEARTBEAT_S = Path(sys.argv[2]), ("tiny.cu",), 0.2
print(b.library_path(say=lambda line: print(line, file=sys.stderr, flush=True)), flush=True)
"""


@pytest.fixture
def setup(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.cu").write_text(TINY)
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(0o755)
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {
        **os.environ,
        "EXPERTD_NVCC": str(nvcc),
        "EXPERTD_KERNEL_CACHE": str(tmp_path / "cache"),
        "FAKE_DIR": str(tmp_path),
    }
    env.pop("EXPERTD_KERNEL_LIB", None)
    env.pop("REAL_NVCC", None)
    yield tmp_path, env
    (tmp_path / "go").touch()  # a failed test leaves no process waiting
    for proc in STARTED:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    STARTED.clear()


def builder(tmp: Path, env: dict, name: str) -> subprocess.Popen:
    """One process asking for the library; its stderr goes to tmp/<name>.err."""
    with open(tmp / f"{name}.err", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(tmp / "driver.py"), str(Path(build.__file__)), str(tmp / "src")],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
            start_new_session=True,
        )
    STARTED.append(proc)
    return proc


def wait_for(check, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def calls(tmp: Path) -> list[str]:
    path = tmp / "calls"
    return path.read_text().split() if path.exists() else []


def test_builders_started_together_compile_once(setup):
    tmp, env = setup
    first = builder(tmp, env, "first")
    wait_for(lambda: len(calls(tmp)) == 1, "the first builder's compile")
    (key_dir,) = [p for p in (tmp / "cache").iterdir() if p.is_dir()]
    assert not (key_dir / build.LIB_NAME).exists(), "nothing in place while it compiles"
    assert list(key_dir.glob(".build-*")), "it compiles in a private directory"
    second = builder(tmp, env, "second")
    wait_for(lambda: "waiting" in (tmp / "second.err").read_text(), "the second one waiting")
    wait_for(lambda: "still compiling" in (tmp / "first.err").read_text(), "a progress line")
    (tmp / "go").touch()
    out = [p.communicate(timeout=WAIT_S)[0].strip() for p in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0]
    assert out[0] == out[1] == str(key_dir / build.LIB_NAME)
    assert len(calls(tmp)) == 1, "one compile for both"
    assert Path(out[0]).read_text() == f"built by {calls(tmp)[0]}\n"
    assert "built by another process" in (tmp / "second.err").read_text()
    assert not list(key_dir.glob(".build-*")), "the private directory is gone"
    third = builder(tmp, env, "third")  # and later ones just load it
    assert third.communicate(timeout=WAIT_S)[0].strip() == out[0]
    assert len(calls(tmp)) == 1 and (tmp / "third.err").read_text() == ""


def test_a_builder_killed_mid_compile_leaves_nothing_loaded(setup):
    tmp, env = setup
    doomed = builder(tmp, env, "doomed")
    wait_for(lambda: len(calls(tmp)) == 1, "the first compile")
    os.killpg(doomed.pid, signal.SIGKILL)  # python, ninja and the compiler
    doomed.wait(timeout=WAIT_S)
    (key_dir,) = [p for p in (tmp / "cache").iterdir() if p.is_dir()]
    assert not (key_dir / build.LIB_NAME).exists()
    (tmp / "go").touch()
    survivor = builder(tmp, env, "survivor")  # the dead one's lock is free
    path = survivor.communicate(timeout=WAIT_S)[0].strip()
    assert survivor.returncode == 0 and len(calls(tmp)) == 2
    assert Path(path).read_text() == f"built by {calls(tmp)[1]}\n"
    assert not list(key_dir.glob(".build-*")), "the killed build's directory was removed"


def test_real_nvcc_two_builders_one_library(setup):
    """The tiny source through the real nvcc with the product's flags (sm_90a), two builders
    at once: one compile, and the library loads (no GPU needed to load it)."""
    tmp, env = setup
    try:
        real = build.find_nvcc()
    except RuntimeError:
        pytest.skip("nvcc not installed")
    env["REAL_NVCC"] = real
    procs = [builder(tmp, env, f"b{i}") for i in range(2)]
    out = {p.communicate(timeout=600)[0].strip() for p in procs}
    assert [p.returncode for p in procs] == [0, 0], [
        (tmp / f"b{i}.err").read_text() for i in range(2)
    ]
    assert len(out) == 1 and len(calls(tmp)) == 1
    lib = ctypes.CDLL(out.pop())
    assert lib.expertd_tiny_answer() == 42
