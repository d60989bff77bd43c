"""Build the CUDA kernels into a plain C-ABI shared library with ninja (no torch C++ ABI).

The library is keyed by a hash of the sources, the flags and the nvcc version, and lives in
`$EXPERTD_KERNEL_CACHE/<key>/libexpertd_kernels.so` (default `~/.cache/expertd/kernels`), so a
container can ship it prebuilt and one build serves any torch.

Environment:
    EXPERTD_KERNEL_CACHE    cache directory (default ~/.cache/expertd/kernels)
    EXPERTD_KERNEL_VERBOSE  1: print the ninja/nvcc log (and ptxas -v register report)
    EXPERTD_KERNEL_LIB      path of a prebuilt library to load instead of building
    EXPERTD_NVCC            the nvcc to use (default: $CUDA_HOME/bin/nvcc, then PATH)

The library has no run-time switches: its configurations and how a call picks one are fixed in
csrc/moe_nvfp4.cu.

Run `python -m expertd.kernels.build` to build and print the library path.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("moe_nvfp4.cu",)
LIB_NAME = "libexpertd_kernels.so"

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


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "expertd" / "kernels"
    return Path(os.environ.get("EXPERTD_KERNEL_CACHE", default)).expanduser().resolve()


def verbose() -> bool:
    return os.environ.get("EXPERTD_KERNEL_VERBOSE", "") not in ("", "0")


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
            "EXPERTD_KERNEL_LIB at a prebuilt libexpertd_kernels.so"
        )
    return found


def build_key(nvcc: str) -> str:
    h = hashlib.sha256()
    for name in sorted(p.name for p in CSRC.iterdir() if p.suffix in (".cu", ".cuh", ".h")):
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(NVCC_FLAGS).encode())
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    h.update(version.encode())
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


def library_path(build: bool = True) -> Path:
    """Path of the built library, building it (ninja + nvcc) on first use."""
    prebuilt = os.environ.get("EXPERTD_KERNEL_LIB")
    if prebuilt:
        return Path(prebuilt)
    nvcc = find_nvcc()
    out_dir = cache_dir() / build_key(nvcc)
    lib = out_dir / LIB_NAME
    if lib.exists() or not build:
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "build.ninja").write_text(_ninja_file(nvcc, out_dir))
    ninja = shutil.which("ninja")
    if ninja is None:
        try:
            import ninja as ninja_pkg  # the pip package ships the binary

            ninja = str(Path(ninja_pkg.BIN_DIR) / "ninja")
        except ImportError as exc:
            raise RuntimeError("ninja not found (pip install ninja)") from exc
    proc = subprocess.run([ninja, "-C", str(out_dir)], capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    (out_dir / "build.log").write_text(log)
    if verbose():
        sys.stderr.write(log)
    if proc.returncode != 0 or not lib.exists():
        raise RuntimeError(f"kernel build failed (log: {out_dir / 'build.log'}):\n{log[-4000:]}")
    return lib


if __name__ == "__main__":
    print(library_path())
