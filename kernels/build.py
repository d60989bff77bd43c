"""Build the CUDA kernels into a plain C-ABI shared library with ninja (no torch C++ ABI).

The library is keyed by a hash of the sources, the flags and the nvcc version, and lives in
`$EXPERTD_KERNEL_CACHE/<key>/libexpertd_kernels.so` (default `~/.cache/expertd/kernels`), so a
container can ship it prebuilt and one build serves any torch.

A build happens once per key, whoever asks first: builders take an exclusive lock on
`<cache>/<key>.lock` (processes that start together wait for the first one and then load its
library), compile into a private directory and move the finished library into place with one
rename, so no process ever loads a half-written file. While nvcc runs, a line every 15 s says
it is still working.

Environment:
    EXPERTD_KERNEL_CACHE    cache directory (default ~/.cache/expertd/kernels)
    EXPERTD_KERNEL_VERBOSE  1: print the ninja/nvcc log (and ptxas -v register report)
    EXPERTD_KERNEL_LIB      path of a prebuilt library to load instead of building
    EXPERTD_NVCC            the nvcc to use (default: $CUDA_HOME/bin/nvcc, then PATH)

The library has no run-time switches: its configurations and how a call picks one are fixed in
csrc/moe_nvfp4.cu. It runs on compute capability 9.0 only (sm_90a: H100, H200); see
TARGET_CAPABILITY and kernels/lookup.py.

`expertd build-kernels` (or `python -m expertd.kernels.build`) builds ahead of time and prints
the library's path on stdout.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("moe_nvfp4.cu", "graph_call.cu", "rows.cu")
LIB_NAME = "libexpertd_kernels.so"
TARGET_ARCH = "sm_90a"
TARGET_CAPABILITY = (9, 0)  # sm_90a code runs on this (major, minor) only
HEARTBEAT_S = 15.0

log = logging.getLogger("expertd.kernels")

# sm_90a, not plain sm_90: wgmma exists only for the arch-specific target. The -gencode form
# because the -arch=sm_90a shorthand also runs a plain sm_90 pass on some nvcc versions.
NVCC_FLAGS = (
    "-O3",
    "-std=c++17",
    "-gencode=arch=compute_90a,code=sm_90a",
    "--shared",
    "-Xcompiler=-fPIC",
    "-cudart=static",
    "-lineinfo",
    "-Xptxas=-v",
    "--expt-relaxed-constexpr",
)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def capability_problem(where: str, capability: tuple[int, int]) -> str | None:
    """Why the compiled kernels cannot run on a GPU of this compute capability (None: they
    can). `where` names the GPU in the message."""
    if tuple(capability) == TARGET_CAPABILITY:
        return None
    want = ".".join(map(str, TARGET_CAPABILITY))
    return (
        f"{where} has compute capability {capability[0]}.{capability[1]}; the compiled kernels "
        f"are {TARGET_ARCH}, for {want} only (H100, H200)"
    )


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "expertd" / "kernels"
    return Path(os.environ.get("EXPERTD_KERNEL_CACHE", default)).expanduser().resolve()


def verbose() -> bool:
    return os.environ.get("EXPERTD_KERNEL_VERBOSE", "") not in ("", "0")


def prebuilt_library() -> Path | None:
    """EXPERTD_KERNEL_LIB, when set: the library to load instead of building one."""
    prebuilt = os.environ.get("EXPERTD_KERNEL_LIB")
    return Path(prebuilt) if prebuilt else None


def find_nvcc() -> str:
    explicit = os.environ.get("EXPERTD_NVCC")
    if explicit:
        return explicit
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if not found:
        raise RuntimeError(
            "nvcc not found: install the CUDA toolkit, set EXPERTD_NVCC, or point "
            "EXPERTD_KERNEL_LIB at a prebuilt libexpertd_kernels.so (`expertd build-kernels` "
            "makes one)"
        )
    return found


def _nvcc_version(nvcc: str) -> str:
    try:
        proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise RuntimeError(f"cannot run nvcc {nvcc}: {e}") from e
    if proc.returncode != 0:
        raise RuntimeError(f"{nvcc} --version failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def build_key(nvcc: str) -> str:
    h = hashlib.sha256()
    for name in sorted(p.name for p in CSRC.iterdir() if p.suffix in (".cu", ".cuh", ".h")):
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(NVCC_FLAGS).encode())
    h.update(_nvcc_version(nvcc).encode())
    return h.hexdigest()[:16]


def _ninja_file(nvcc: str, out_dir: Path) -> str:
    srcs = " ".join(str(CSRC / s) for s in SOURCES)
    deps = " ".join(str(p) for p in sorted(CSRC.iterdir()) if p.suffix in (".cuh", ".h"))
    implicit = f" | {deps}" if deps else ""
    flags = " ".join(NVCC_FLAGS)
    return (
        "ninja_required_version = 1.3\n"
        f"nvcc = {nvcc}\n"
        f"flags = {flags}\n"
        "rule nvcc_so\n"
        "  command = $nvcc $flags $in -o $out\n"
        "  description = nvcc $out\n"
        f"build {out_dir / LIB_NAME}: nvcc_so {srcs}{implicit}\n"
    )


def _find_ninja() -> str:
    ninja = shutil.which("ninja")
    if ninja is not None:
        return ninja
    try:
        import ninja as ninja_pkg  # the pip package ships the binary
    except ImportError as exc:
        raise RuntimeError("ninja not found (pip install ninja)") from exc
    return str(Path(ninja_pkg.BIN_DIR) / "ninja")


class _FileLock:
    """An exclusive flock on `path`, held from __enter__ to __exit__ (released if we die)."""

    def __init__(self, path: Path, say: Callable[[str], None]) -> None:
        self.path, self.say, self.fd = path, say, -1

    def __enter__(self) -> _FileLock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.say(f"kernels: another process is building them; waiting (lock {self.path})")
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _compile(ninja_text: str, work: Path, say: Callable[[str], None]) -> str:
    """Run ninja in `work` with a heartbeat; -> its log (raises on failure)."""
    (work / "build.ninja").write_text(ninja_text)
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as out:
        # Its own process group, so a Ctrl-C or kill of ours takes nvcc down with ninja.
        proc = subprocess.Popen(
            [_find_ninja(), "-C", str(work)], stdout=out, stderr=out, start_new_session=True
        )
        while True:
            try:
                proc.wait(timeout=HEARTBEAT_S)
                break
            except subprocess.TimeoutExpired:
                say(f"kernels: nvcc still compiling ({time.monotonic() - start:.0f} s)")
            except BaseException:  # Ctrl-C or a signal: leave no compiler behind
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
        out.seek(0)
        log = out.read()
    (work / "build.log").write_text(log)
    if verbose():
        sys.stderr.write(log)
    if proc.returncode != 0 or not (work / LIB_NAME).exists():
        raise RuntimeError(f"kernel build failed (log: {work / 'build.log'}):\n{log[-4000:]}")
    return log


def library_path(build: bool = True, say: Callable[[str], None] | None = None) -> Path:
    """Path of the built library, building it (ninja + nvcc) on first use.

    `build=False` returns where the library is or would be without building. `say` gets the
    progress lines (default: the expertd.kernels logger, at INFO)."""
    prebuilt = prebuilt_library()
    if prebuilt is not None:
        if build and not prebuilt.is_file():
            raise RuntimeError(f"EXPERTD_KERNEL_LIB={prebuilt}: no such file")
        return prebuilt
    nvcc = find_nvcc()
    key = build_key(nvcc)
    out_dir = cache_dir() / key
    lib = out_dir / LIB_NAME
    if lib.exists() or not build:
        return lib
    say = say or log.info
    out_dir.mkdir(parents=True, exist_ok=True)
    with _FileLock(cache_dir() / f"{key}.lock", say):
        if lib.exists():  # built by the process we waited for
            say(f"kernels: built by another process: {lib}")
            return lib
        say(
            f"kernels: compiling {', '.join(SOURCES)} for {TARGET_ARCH} with {nvcc} into "
            f"{out_dir} (once per source version; minutes on a small CPU)"
        )
        for stale in out_dir.glob(".build-*"):  # a killed builder's (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        start = time.monotonic()
        # A private directory beside the final one (same filesystem: the rename is atomic);
        # what a killed build leaves there is never loaded, and is removed by the next one.
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=out_dir))
        try:
            _compile(_ninja_file(nvcc, work), work, say)
            os.replace(work / "build.log", out_dir / "build.log")
            os.replace(work / LIB_NAME, lib)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        say(f"kernels: built {lib} in {time.monotonic() - start:.0f} s")
    return lib


def main() -> int:
    """Build (or find) the library and print its path: `expertd build-kernels`."""
    try:
        print(library_path(say=_stderr))
    except RuntimeError as e:
        _stderr(f"expertd build-kernels: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
