"""The client's sum of the shards' answers in C (client/csrc/combine.c), built once per machine.

numpy's form of that sum (client/core.py) stages every answer as float32 and makes about four
passes over it; the C routine makes one, on the calling thread (no thread pool: the client's
event loop must not wait on workers, see client/core.py). It is compiled with the system C
compiler (`$CC`, else `cc`) at the first call, into `$EXPERTD_KERNEL_CACHE/host-<hash>/`
(default ~/.cache/expertd/kernels), and loaded through ctypes; a machine without a compiler
gets `None` from `library()` and the numpy form. EXPERTD_NATIVE_COMBINE=0 forces numpy.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from expertd.kernels.build import cache_dir  # the kernels' cache: one place for built code

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "combine.c"
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c99")  # never -ffast-math: the order is the contract

_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | None] = {}


def _build(compiler: str) -> Path:
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    lib = cache_dir() / f"host-{key}" / "libexpertd_host.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed into place: a process loading it never sees a
    # half-written file, and two processes building at once both succeed.
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        subprocess.run(
            [compiler, *FLAGS, "-o", str(out), str(SOURCE)],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(out, lib)
    return lib


def _load() -> ctypes.CDLL | None:
    if os.environ.get("EXPERTD_NATIVE_COMBINE", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: the client sums answers in numpy")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or e
        log.warning("building client/csrc/combine.c failed, summing in numpy: %s", detail)
        return None
    fn = lib.expertd_combine_bf16
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_void_p,  # out
        ctypes.c_int64,  # m
        ctypes.c_int64,  # h
        ctypes.c_int32,  # n
        ctypes.c_void_p,  # rows: const int64_t *const *
        ctypes.c_void_p,  # counts
        ctypes.c_void_p,  # bits: const uint16_t *const *
        ctypes.c_void_p,  # acc
        ctypes.c_int64,  # block_rows
    ]
    return lib


def library() -> ctypes.CDLL | None:
    """The built library, or None (no compiler, a failed build, or switched off)."""
    with _lock:
        if "lib" not in _state:
            _state["lib"] = _load()
        return _state["lib"]
