"""The same-host data plane's shared pieces: a slot's memory layout, its control
block, the futex doorbell, sealed memfds and the lease socket's messages.

Both ends use these: the shard server (server/slots.py) creates and serves the
slots, the client (client/shm.py) fills them. docs/dataplane.md describes the
protocol; in short, a slot is one shared memory object holding

    control block (4 KiB) | x bf16 [Mmax, H] | ids int32 [Mmax, K] | w fp32 [Mmax, K] |
    out bf16 [Mmax, H]

and a call is: the client writes m rows (x, ids, w packed as [m, H], [m, k], [m, k]
at the start of their regions) and the call's header, stores req_seq + 1 and
wakes the futex on req_seq; the shard computes, writes out [m, H], the status
and the timing, stores resp_seq = req_seq and wakes the futex on resp_seq.

Linux only (memfd, abstract unix sockets, futex). The words are read and written
with single aligned 32-bit loads and stores; on x86-64 (total store order) a
store of the sequence word is seen only after the stores before it, which is
what the protocol relies on. The futex syscall is a full barrier on any arch.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import platform
import socket
import struct
import time
from dataclasses import dataclass

PAGE = 4096
CONTROL_BYTES = PAGE
ERROR_BYTES = 1024  # the error text's room in the control block

SHM = "shm"
CUDA_IPC = "cuda-ipc"
GRPC = "grpc"

# Lease socket messages (SOCK_SEQPACKET: each send is one message).
HELLO = b"H"  # client -> shard: HELLO + token
FDS = b"F"  # shard -> client: FDS + lease id, with the slots' fds attached
PROOF = b"P"  # client -> shard: PROOF + 8-byte nonces, one per slot (written in the slots)
READY = b"R"  # shard -> client: the lease is live
HANDLES = b"C"  # shard -> client (cuda-ipc): HANDLES + one CUDA IPC handle per slot, after FDS
REFUSED = b"X"  # shard -> client: REFUSED + why (then the socket closes)
DONE = b"D"  # shard -> client: DONE + slot index (u32), sent when the call asked (notify)

FLAG_NOTIFY = 1  # control flags: also send DONE on the lease socket when finished
FLAG_STREAM = 2  # cuda-ipc: queued on the client's stream, which waits for done_seq
# cuda-ipc, with FLAG_STREAM: a call captured in the client's CUDA graph. Every replay
# rings with the same req_seq (GRAPH_SEQ: a graph replays values fixed at capture), so the
# shard's waiter sets req_seq back to 0 as it takes the call, and the client's stream,
# which stored done_seq = 0 before ringing, waits for done_seq == GRAPH_SEQ.
FLAG_GRAPH = 4
GRAPH_SEQ = 1


class Control(ctypes.Structure):
    """The control block at the start of each slot (little-endian, 8-aligned)."""

    _fields_ = (
        ("req_seq", ctypes.c_uint32),  # client -> shard doorbell (futex word)
        ("resp_seq", ctypes.c_uint32),  # shard -> client doorbell (futex word)
        ("layer", ctypes.c_uint32),
        ("m", ctypes.c_uint32),
        ("k", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("status", ctypes.c_int32),  # a grpc.StatusCode value; 0 = OK
        ("error_len", ctypes.c_uint32),
        ("timeout_us", ctypes.c_uint64),  # how long the client waits for this call; 0 = no limit
        ("nonce", ctypes.c_uint64),  # registration proof: written by the client
        ("out_rows", ctypes.c_uint32),
        ("_pad0", ctypes.c_uint32),
        ("request_id", ctypes.c_uint64),  # the caller's, for the server's logs
        # timing of the last call, as in expertd.v1.Timing (microseconds)
        ("queue_us", ctypes.c_uint64),
        ("compute_us", ctypes.c_uint64),
        ("total_us", ctypes.c_uint64),
        ("stage_us", ctypes.c_uint64),
        ("device_us", ctypes.c_uint64),
        ("batch_requests", ctypes.c_uint32),
        ("batch_tokens", ctypes.c_uint32),
        # the caller's span (W3C trace context, expertd.tracing.context_fields); span_id
        # 0: none. Written by the client with each call.
        ("trace_hi", ctypes.c_uint64),
        ("trace_lo", ctypes.c_uint64),
        ("span_id", ctypes.c_uint64),
        ("trace_flags", ctypes.c_uint32),
        ("_pad1", ctypes.c_uint32),
        # when the shard's waiter saw the doorbell, and when it rang the answer
        # (CLOCK_MONOTONIC ns, time.monotonic_ns: one clock for every process of a host),
        # so the caller can tell the two wake-ups from the shard's own time
        ("seen_ns", ctypes.c_uint64),
        ("answered_ns", ctypes.c_uint64),
        # What the shard's slot offers (FEATURE_* bits, written once when it is made; 0
        # from a shard that predates them), and how this lease's client wakes the waiter
        # (WAKE_SEM: it posts the slot's semaphore, not FUTEX_WAKE; written before PROOF).
        ("features", ctypes.c_uint32),
        ("wake", ctypes.c_uint32),
        # cuda-ipc: the call's rows are in the out region (the shard's stream stores seq
        # here once its copies are done, before the host has looked at the call's flags;
        # the host stores it too with every answer, error or not). A call queued on the
        # client's stream (FLAG_STREAM) waits for this word, not for resp_seq.
        ("done_seq", ctypes.c_uint32),
        # FLAG_GRAPH calls: how many ended in an error, and the last one's status (its
        # text in the error region); the client reads them, as no host waits per call
        ("graph_errors", ctypes.c_uint32),
        ("graph_status", ctypes.c_int32),
    )


# A process-shared POSIX semaphore (glibc's sem_t: 32 bytes) in bytes [192, 224) of a
# cuda-ipc slot's control block: the waiter's wake-up when the doorbell is rung from a
# CUDA stream (the stream writes req_seq, then runs sem_post as a host function: a
# function of one pointer, which FUTEX_WAKE through syscall() is not).
SEM_OFFSET = 192
SEM_BYTES = 32
FEATURE_SEM = 1  # the slot's semaphore is initialized: the client may wake with it
FEATURE_GRAPH = 2  # the shard takes FLAG_GRAPH calls (sets req_seq back to 0 as it takes one)
WAKE_SEM = 1
ERROR_OFFSET = 256  # error text: bytes [256, 256 + ERROR_BYTES) of the control block
assert ctypes.sizeof(Control) <= SEM_OFFSET
assert SEM_OFFSET + SEM_BYTES <= ERROR_OFFSET
assert ERROR_OFFSET + ERROR_BYTES <= CONTROL_BYTES

TIMING_FIELDS = (
    "queue_us",
    "compute_us",
    "total_us",
    "stage_us",
    "device_us",
    "batch_requests",
    "batch_tokens",
)


def _round(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def round_pages(n: int) -> int:
    """n bytes rounded up to whole pages."""
    return _round(n)


@dataclass(frozen=True, slots=True)
class Layout:
    """Byte offsets of one slot's regions (the same formula on both ends).

    `device` (cuda-ipc): x and out live in a separate device buffer (x at 0, out at
    `device_out_offset`, `device_bytes` in all); the host slot keeps the control
    block, ids and weights, and its x and out regions are empty."""

    max_tokens: int  # Mmax
    top_k: int  # K
    hidden: int  # H
    device: bool = False

    @property
    def _rows_bytes(self) -> int:
        """One [Mmax, H] bf16 region, rounded to pages."""
        return _round(2 * self.max_tokens * self.hidden)

    @property
    def x_offset(self) -> int:
        return CONTROL_BYTES

    @property
    def ids_offset(self) -> int:
        return self.x_offset + (0 if self.device else self._rows_bytes)

    @property
    def weights_offset(self) -> int:
        return self.ids_offset + _round(4 * self.max_tokens * self.top_k)

    @property
    def out_offset(self) -> int:
        return self.weights_offset + _round(4 * self.max_tokens * self.top_k)

    @property
    def byte_size(self) -> int:
        return self.out_offset + (0 if self.device else self._rows_bytes)

    @property
    def device_out_offset(self) -> int:
        """cuda-ipc: where out starts in the device buffer (x starts at 0)."""
        return self._rows_bytes

    @property
    def device_bytes(self) -> int:
        """cuda-ipc: the device buffer's size (0 for host slots)."""
        return 2 * self._rows_bytes if self.device else 0

    @property
    def input_bytes(self) -> int:
        """The input regions' span: [x_offset, out_offset)."""
        return self.out_offset - self.x_offset

    def to_proto(self, pb):
        return pb.SlotLayout(
            control_offset=0,
            control_bytes=CONTROL_BYTES,
            x_offset=self.x_offset,
            ids_offset=self.ids_offset,
            weights_offset=self.weights_offset,
            out_offset=self.out_offset,
            byte_size=self.byte_size,
            max_tokens=self.max_tokens,
            top_k=self.top_k,
            hidden_size=self.hidden,
        )

    def check(self, m: int, k: int) -> None:
        """ValueError unless a call of m rows and k routes per row fits a slot."""
        if m > self.max_tokens or (m and k > self.top_k):
            raise ValueError(
                f"{m} x {k} routes do not fit a slot of {self.max_tokens} x {self.top_k}"
            )

    @classmethod
    def from_proto(cls, msg, device: bool = False) -> Layout:
        """The layout the server described; ValueError when its offsets are not ours."""
        layout = cls(msg.max_tokens, msg.top_k, msg.hidden_size, device)
        if (
            msg.x_offset,
            msg.ids_offset,
            msg.weights_offset,
            msg.out_offset,
            msg.byte_size,
        ) != (
            layout.x_offset,
            layout.ids_offset,
            layout.weights_offset,
            layout.out_offset,
            layout.byte_size,
        ):
            raise ValueError("the server's slot layout differs from this client's")
        return layout


# -- futex ------------------------------------------------------------------------------

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())
FUTEX_WAIT = 0  # shared (not FUTEX_PRIVATE_FLAG): the word lives in memory of two processes
FUTEX_WAKE = 1


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


_libc = ctypes.CDLL(None, use_errno=True)  # CDLL: the GIL is released during each call
_syscall = _libc.syscall
_sched_yield = _libc.sched_yield
_syscall.restype = ctypes.c_long
_sem_init = _libc.sem_init
_sem_init.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint)
_sem_post = _libc.sem_post
_sem_post.argtypes = (ctypes.c_void_p,)
_sem_timedwait = _libc.sem_timedwait
_sem_timedwait.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
_sem_wait = _libc.sem_wait
_sem_wait.argtypes = (ctypes.c_void_p,)


def available() -> bool:
    """Can this process use the same-host data plane at all?"""
    return _SYS_FUTEX is not None and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


def futex_wait(addr: int, expected: int, timeout_s: float | None) -> None:
    """Sleep while the u32 at `addr` equals `expected`, at most timeout_s (None: no limit).
    Returns on a wake-up, a timeout, a signal or a changed word: the caller re-reads it."""
    if timeout_s is None:
        ts = None
    else:
        timeout_s = max(timeout_s, 0.0)
        sec = int(timeout_s)
        ts = ctypes.byref(_Timespec(sec, int((timeout_s - sec) * 1e9)))
    _syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(addr),
        ctypes.c_int(FUTEX_WAIT),
        ctypes.c_uint32(expected),
        ts,
        None,
        ctypes.c_int(0),
    )


def futex_wake(addr: int) -> None:
    """Wake every waiter on the u32 at `addr`."""
    _syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(addr),
        ctypes.c_int(FUTEX_WAKE),
        ctypes.c_int(0x7FFFFFFF),
        None,
        None,
        ctypes.c_int(0),
    )


# Waiters spin longer (a shard's waiter keeps its slots' pace, a caller spins through its
# answers' jitter) only in a process with this many usable CPUs or more (`usable_cpus`):
# with fewer, spinning takes the cores that the shards and the client beside it need (8
# shards and a client on 2 cores).
SPARE_CPUS = 4
_SPARE: bool | None = None
CGROUP_V2_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_CPU = "/sys/fs/cgroup/cpu"


def cpu_quota(v2: str = CGROUP_V2_CPU_MAX, v1: str = CGROUP_V1_CPU) -> float | None:
    """The CPUs this process's cgroup may use by its CFS quota (a container's CPU
    limit: its affinity still lists every core of the host), or None: no quota."""
    try:
        with open(v2) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(f"{v1}/cpu.cfs_quota_us") as f:
            quota = int(f.read())
        with open(f"{v1}/cpu.cfs_period_us") as f:
            period = int(f.read())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cpus() -> float:
    """CPUs this process may run on: its affinity, capped by its cgroup's quota."""
    n = float(len(os.sched_getaffinity(0)))
    quota = cpu_quota()
    return n if quota is None else min(n, quota)


def spare_cpus() -> bool:
    """May this process's waiters spin for longer (SPARE_CPUS usable CPUs or more)?"""
    global _SPARE
    if _SPARE is None:
        _SPARE = usable_cpus() >= SPARE_CPUS
    return _SPARE


# Keeping pace (a shard's waiters with spare CPUs: server/slots.py's doorbell waiters,
# expertd/nixl.py's progress thread): up NEXT_EARLY_S before the next call is due (the
# shortest recent gap, if under NEXT_MAX_S), spinning for it at most NEXT_EARLY_S +
# NEXT_SPIN_S. A sleeping waiter is woken 60 us after the doorbell on the 2-core machine,
# more on a host whose idle cores sleep deeply.
NEXT_EARLY_S = 100e-6
NEXT_SPIN_S = 50e-6
NEXT_MAX_S = 5e-3
# Without spare CPUs a shard's waiters keep only a back-to-back caller's pace: gaps under
# NEXT_MAX_FEW_S (the caller sums one answer and writes the next call), so eight shards
# on two cores, whose gaps are the whole call's time, never spin (docs/dataplane.md).
NEXT_MAX_FEW_S = 5e-4


class Recent:
    """The last few durations of something that recurs (a slot's answer time, the gap
    before its next call), to wake a sleeping waiter shortly before the next one is
    due: `low()` is the shortest of them (0.0 before the first), so the waiter is up
    before nearly every arrival even when they jitter; a single slow one does not
    move it."""

    __slots__ = ("_i", "_v")
    SIZE = 8

    def __init__(self) -> None:
        self._v: list[float] = []
        self._i = 0

    def add(self, seconds: float) -> None:
        if len(self._v) < self.SIZE:
            self._v.append(seconds)
        else:
            self._v[self._i] = seconds
            self._i = (self._i + 1) % self.SIZE

    def low(self) -> float:
        return min(self._v) if self._v else 0.0

    def high(self) -> float:
        return max(self._v) if self._v else 0.0


def sem_init(addr: int) -> None:
    """A process-shared semaphore of value 0 at `addr` (SEM_BYTES, 8-aligned)."""
    if _sem_init(addr, 1, 0) != 0:
        raise OSError(ctypes.get_errno(), "sem_init failed")


def sem_post(addr: int) -> None:
    _sem_post(addr)


def sem_post_address() -> int:
    """libc's sem_post, as a function pointer (a CUDA host function: void (*)(void*))."""
    return ctypes.cast(_sem_post, ctypes.c_void_p).value


def sem_sleep(addr: int, timeout_s: float | None) -> None:
    """Sleep until the semaphore at `addr` is posted (taking one post), at most
    timeout_s (None: no limit). Returns on a post, a timeout or a signal: the caller
    re-reads the word it waits for (a post may be older than the change it announced)."""
    if timeout_s is None:
        _sem_wait(addr)
        return
    end = time.time() + max(timeout_s, 0.0)  # sem_timedwait takes CLOCK_REALTIME
    sec = int(end)
    _sem_timedwait(addr, ctypes.byref(_Timespec(sec, int((end - sec) * 1e9))))


def wait_word(
    ctl: Control,
    field: str,
    addr: int,
    old: int,
    deadline: float | None,
    spin_s: float,
    sem: int = 0,
) -> bool:
    """Wait until ctl.<field> != old (True) or time.monotonic() passes `deadline` (False):
    spin for spin_s, then sleep in FUTEX_WAIT slices (GIL released), or on the
    semaphore at `sem` when given (a word a CUDA stream writes: no FUTEX_WAKE follows)."""
    if getattr(ctl, field) != old:
        return True
    now = time.monotonic()
    spin_end = now + spin_s
    while now < spin_end:
        if getattr(ctl, field) != old:
            return True
        _sched_yield()  # the GIL and this core to whoever waits for them, if anyone does
        now = time.monotonic()
    while True:
        if getattr(ctl, field) != old:
            return True
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return False
        if sem:
            sem_sleep(sem, None if deadline is None else deadline - now)
        else:
            futex_wait(addr, old, None if deadline is None else deadline - now)


# -- memory ----------------------------------------------------------------------------

F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 0x0004)
F_SEAL_SEAL = getattr(fcntl, "F_SEAL_SEAL", 0x0001)


def sealed_memfd(name: str, size: int) -> int:
    """A memfd of `size` bytes that nobody can shrink or grow (so no holder of it can make
    another's mapping fault), and whose seals are final."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_sealed(fd: int) -> bool:
    seals = fcntl.fcntl(fd, F_GET_SEALS)
    return bool(seals & F_SEAL_SHRINK) and bool(seals & F_SEAL_GROW)


# -- the lease socket ------------------------------------------------------------------


def abstract_address(name: str) -> str:
    """A socket address in Linux's abstract namespace (no file; gone with its owner)."""
    return "\0" + name


def pack_u32(value: int) -> bytes:
    return struct.pack("<I", value)


def unpack_u32(data: bytes) -> int:
    return struct.unpack("<I", data[:4])[0]


def host_buffer(nbytes: int):
    """uint8 [nbytes] of private anonymous memory for a slot that lives in this process
    (tcp, nixl): pages appear only where written, 4 KiB at a time. (numpy asks for
    transparent huge pages on arrays of 4 MiB or more, so the first byte written to
    each region of a slot would bring in 2 MiB: a slot of a few rows then held ~8 MiB
    on each end.)"""
    import numpy as np

    mm = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mm.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(mm, np.uint8)[:nbytes]
