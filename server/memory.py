"""Giving freed heap memory back to the system.

Requests of tens of MiB, and partial ones cut by the receive timeout, are received
by gRPC's core into many small buffers; once freed, glibc keeps those pages in the
process (fragmented between live allocations) instead of returning them, so a
burst of large or stalled uploads would leave the server's resident memory at its
peak for good. `HeapTrimmer` looks at the bytes malloc holds free (mallinfo2) every
`period_s` and, when they have grown by `growth_bytes` since its last look back,
asks glibc to return free pages (malloc_trim). Nothing happens where glibc is not
the allocator.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("expertd.server")

_PAGE = os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",  # bytes in free chunks
            "keepcost",
        )
    ]


def _glibc():
    """(malloc_trim, mallinfo2) from glibc >= 2.33, or None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim, info = libc.malloc_trim, libc.mallinfo2
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    info.argtypes, info.restype = [], _MallInfo2
    return trim, info


_GLIBC = _glibc()


def resident_bytes() -> int:
    """This process's resident set size (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


def free_heap_bytes() -> int:
    """Bytes malloc holds in free chunks (0 where glibc does not say)."""
    return _GLIBC[1]().fordblks if _GLIBC else 0


class HeapTrimmer:
    def __init__(self, period_s: float = 2.0, growth_bytes: int = 64 << 20) -> None:
        self.period_s = period_s
        self.growth_bytes = growth_bytes
        self._low = 0  # free bytes after the last trim, or the least seen since
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if _GLIBC is not None and self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            free = free_heap_bytes()
            self._low = min(self._low, free)  # reused since: what is freed anew counts
            if free - self._low >= self.growth_bytes:
                await self.trim()

    async def trim(self) -> int:
        """Return free heap pages now (on a thread: ctypes lets go of the GIL, and a
        large heap takes milliseconds to walk); returns the resident bytes given back."""
        before = resident_bytes()
        await asyncio.to_thread(_GLIBC[0], 0)
        self._low = free_heap_bytes()
        returned = max(before - resident_bytes(), 0)
        if returned >= self.growth_bytes:
            log.info("returned %.0f MiB of freed memory to the system", returned / 2**20)
        return returned
