"""Build the CUDA kernels into a plain C-ABI shared library with ninja (no torch C++ ABI).

The library is keyed by a hash of the sources, the flags and the nvcc version, and lives in
`$EXPERTD_KERNEL_CACHE/<key>/libexpertd_kernels.so` (default `~/.cache/expertd/kernels`), so a
container can ship it prebuilt and one build serves any torch.

Environment:
    EXPERTD_KERNEL_CACHE    cache directory (default ~/.cache/expertd/kernels)
    EXPERTD_KERNEL_VERBOSE  1: print the ninja/nvcc log (and ptxas -v register report)
    EXPERTD_KERNEL_LIB      path of a prebuilt library to load instead of building
    EXPERTD_NVCC            the nvcc to use (default: $CUDA_HOME/bin/nvcc, then PATH)
    EXPERTD_KERNEL_DEFINES  "-DEXPERTD_X=v ...": compile-time kernel variants (own cache key)
    EXPERTD_KERNEL_TIMELINE 1: build (and load) the instrumented library whose kernels record
                            %globaltimer events for benchmarks/timeline.py

Read by the library per call (a CUDA graph keeps what it was captured with):
    EXPERTD_KERNEL_PDL      0: no programmatic dependent launch between the kernels
    EXPERTD_KERNEL_PATH     6 or 8: force one GEMM path where the tile size has it (default:
                            v8 (wgmma) from BT 16 (BT 24: v6), v6 below; any other value
                            forces nothing)
    EXPERTD_KERNEL_WG_RING  v8 ring (same bits): 2 block barrier, copies after the stage's
                            wgmmas; 3 ring 2 with the next unit dequantized under the current
                            unit's wgmmas. Default: 3 at BT 48 and from BT 96, 2 at 16, 32, 64
    EXPERTD_KERNEL_WG_FULLN 1: every v8 tile runs wgmma N = BT, not its routes rounded up to 8
                            (BT 16) or 16 (same bits; an A/B switch)
    EXPERTD_KERNEL_WG_MIN_N 16: no v8 tile runs an MMA narrower than 16 (same bits; A/B)
    EXPERTD_KERNEL_ROUTE_MULTI         calls of at least N routes are routed by blocks over
                                       chunks (default 16384; 0: never, one routing block)
    EXPERTD_KERNEL_ROUTE_BALANCE       1: fill an expert's tiles round-robin (same bits; an
                                       experiment); default: in order
    EXPERTD_KERNEL_GRID_ROWS           v6 grid rows cap (blocks loop over tiles; same bits); 0:
                                       none; unset: 2 for calls of <= 64 routes
    EXPERTD_KERNEL_OVF                 F: one-tile v6 grids (BT 8) on ceil(F L / 8) + min(F L, El)
                                       rows, L the local routes uniform routing expects, later
                                       tiles looped over (same bits); 0: one row per possible
                                       tile; unset: 2, for GEMM2 from 512 routes, GEMM1 from 1024
    EXPERTD_KERNEL_OVF_GEMMS           which GEMMs take those rows: bit 0 GEMM1, bit 1 GEMM2
                                       (an A/B switch); unset: by call size as above
    EXPERTD_KERNEL_DECODE_ALT          v6 configuration alternative id (moe_nvfp4.cu); unset:
                                       28 / 13 / 18 for BT 8 calls of <= 8 / < 128 routes / more
                                       where H and I are multiples of 512; 0: the table's
    EXPERTD_KERNEL_ROUTE_WARP          0: route_kernel's general tables (barriers after the
                                       count); default: barrier-free tables for <= 32 local
                                       experts (same bits; A/B)
    EXPERTD_KERNEL_SELF_ROUTE          0: route_kernel for every call (same bits; A/B); default:
                                       GEMM1 routes calls of <= 64 routes on <= 32 experts
    EXPERTD_KERNEL_FIN_SERIAL          1: finalize loads a token's routes one after another at
                                       every M (same bits; A/B); default: together below 512
                                       tokens
    EXPERTD_KERNEL_ROUTE_THREADS       256 or 1024: route_kernel's block (same bits; A/B);
                                       default: 256 for calls of <= 64 routes (those that
                                       launch it: EXPERTD_KERNEL_SELF_ROUTE)

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

# sm_90a (not plain sm_90) so wgmma/setmaxnreg stay available to later versions; -gencode form
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


def nvcc_flags() -> tuple[str, ...]:
    """NVCC_FLAGS, plus -DEXPERTD_TIMELINE under EXPERTD_KERNEL_TIMELINE=1 and the -D macros of
    EXPERTD_KERNEL_DEFINES (space-separated "-DEXPERTD_NAME=value" macros: compile-time
    variants for a library A/B). Each is a separate library: the flags are part of the cache key."""
    flags = NVCC_FLAGS
    if os.environ.get("EXPERTD_KERNEL_TIMELINE", "") == "1":
        flags = (*flags, "-DEXPERTD_TIMELINE")
    defines = os.environ.get("EXPERTD_KERNEL_DEFINES", "").split()
    bad = [d for d in defines if not d.startswith("-DEXPERTD_")]
    if bad:
        raise ValueError(f"EXPERTD_KERNEL_DEFINES takes -DEXPERTD_... macros only, not {bad}")
    return (*flags, *defines)


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
    h.update(" ".join(nvcc_flags()).encode())
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    h.update(version.encode())
    return h.hexdigest()[:16]


def _ninja_file(nvcc: str, out_dir: Path) -> str:
    srcs = " ".join(str(CSRC / s) for s in SOURCES)
    deps = " ".join(str(p) for p in sorted(CSRC.iterdir()) if p.suffix in (".cuh", ".h"))
    implicit = f" | {deps}" if deps else ""
    flags = " ".join(nvcc_flags())
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
