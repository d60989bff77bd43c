"""The armed graph of kernels/csrc/armed.cu through ctypes: a graph that, once a device word
says which of a set of slots holds a call, copies the call into a bank's packed input, runs
the captured forward of its (layer, bucket) through a CUDA switch node, and copies the rows
out and stores the slot's done word. The server decides what to arm and when
(server/armed.py); nothing here knows of clients or leases.

Shape legend: as kernels/cuda.py.
"""

from __future__ import annotations

import ctypes

from expertd.kernels.cuda import load_library


class ArmSlot(ctypes.Structure):
    # Mirrors struct ExpertdArmSlot.
    _fields_ = [("ctl", ctypes.c_void_p), ("x", ctypes.c_void_p), ("out", ctypes.c_void_p)]


class ArmWords(ctypes.Structure):
    # Mirrors struct ExpertdArmWords: byte offsets in a control block.
    _fields_ = [
        ("req_seq", ctypes.c_int),
        ("layer", ctypes.c_int),
        ("m", ctypes.c_int),
        ("k", ctypes.c_int),
        ("flags", ctypes.c_int),
        ("done_seq", ctypes.c_int),
        ("taken_seq", ctypes.c_int),
        ("armed_bad", ctypes.c_int),
        ("ids", ctypes.c_longlong),
        ("weights", ctypes.c_longlong),
    ]


class ArmPlan(ctypes.Structure):
    # Mirrors struct ExpertdArmPlan, field for field.
    _fields_ = [
        ("slots", ctypes.c_void_p),
        ("num_slots", ctypes.c_int),
        ("ring_seq", ctypes.c_void_p),
        ("ring_slot", ctypes.c_void_p),
        ("ring", ctypes.c_int),
        ("entry", ctypes.c_void_p),
        ("cancel", ctypes.c_void_p),
        ("layer_body", ctypes.c_void_p),
        ("num_layers", ctypes.c_int),
        ("buckets", ctypes.c_void_p),
        ("num_buckets", ctypes.c_int),
        ("top_k", ctypes.c_int),
        ("hidden", ctypes.c_int),
        ("num_experts", ctypes.c_int),
        ("bank_in", ctypes.c_void_p),
        ("bank_out", ctypes.c_void_p),
        ("info", ctypes.c_void_p),
        ("words", ArmWords),
    ]


# info words the graph leaves on the device (int32): the body run (-1: none), m, the slot,
# the call's seq, the bucket's index, 1 when a row held NaN/Inf
INFO_WORDS = 6


def _lib() -> ctypes.CDLL:
    lib = load_library()
    if not getattr(lib, "_armed_typed", False):
        lib.expertd_armed_error.restype = ctypes.c_char_p
        lib.expertd_armed_stream.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.expertd_armed_stream_destroy.argtypes = [ctypes.c_void_p]
        lib.expertd_armed_build.argtypes = [
            ctypes.POINTER(ArmPlan),
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_void_p),
        ]
        lib.expertd_armed_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.expertd_armed_destroy.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib._armed_typed = True
    return lib


def _check(lib: ctypes.CDLL, rc: int) -> None:
    if rc != 0:
        raise RuntimeError(f"armed graph: {lib.expertd_armed_error().decode()}")


def nonblocking_stream() -> int:
    """A new cudaStream_t (as an int) that never waits for the legacy default stream."""
    lib = _lib()
    s = ctypes.c_void_p()
    _check(lib, lib.expertd_armed_stream(ctypes.byref(s)))
    return s.value


def destroy_stream(stream: int) -> None:
    lib = _lib()
    _check(lib, lib.expertd_armed_stream_destroy(stream))


class ArmedGraph:
    """The instantiated graph for `plan` over `bodies` (cudaGraph_t ints, body i = layer
    index i // num_buckets, bucket i % num_buckets); launched once per armed entry."""

    def __init__(self, plan: ArmPlan, bodies: list[int], grid: int) -> None:
        lib = _lib()
        arr = (ctypes.c_void_p * len(bodies))(*bodies)
        self._exec, self._graph = ctypes.c_void_p(), ctypes.c_void_p()
        _check(
            lib,
            lib.expertd_armed_build(
                ctypes.byref(plan),
                arr,
                len(bodies),
                grid,
                ctypes.byref(self._exec),
                ctypes.byref(self._graph),
            ),
        )

    def launch(self, stream: int) -> None:
        lib = _lib()
        _check(lib, lib.expertd_armed_launch(self._exec, stream))

    def destroy(self) -> None:
        if self._exec:
            lib = _lib()
            lib.expertd_armed_destroy(self._exec, self._graph)
            self._exec = self._graph = ctypes.c_void_p()
