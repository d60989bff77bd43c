"""A slot buffer kept in this process (tcp, nixl: expertd.dataplane.host_buffer) holds
only the pages written to it: writing a few rows at the start of each region of a
large slot does not bring in huge pages."""

from __future__ import annotations

import numpy as np

from expertd import dataplane as dp


def resident_kib(array: np.ndarray) -> tuple[int, int]:
    """(Rss, AnonHugePages) in KiB of the mappings over `array`'s bytes (a madvise
    on part of a mapping splits it in several)."""
    lo_a = array.ctypes.data
    hi_a = lo_a + array.nbytes
    rss = huge = 0
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo < hi_a and lo_a < hi
            elif inside and head == "Rss:":
                rss += int(line.split()[1])
            elif inside and head == "AnonHugePages:":
                huge += int(line.split()[1])
    return rss, huge


def test_a_large_slot_holds_only_the_pages_written():
    layout = dp.Layout(16384, 64, 4096)  # ~264 MiB: a slot for the server's largest call
    buf = dp.host_buffer(layout.byte_size)
    assert buf.size == layout.byte_size and buf.flags.writeable and not buf.any()
    for offset in (layout.x_offset, layout.ids_offset, layout.weights_offset, layout.out_offset):
        buf[offset : offset + 8192] = 1  # one row of bf16 at H = 4096, say
    rss, huge = resident_kib(buf)
    assert huge == 0
    assert rss <= 4 * 8 + 16, f"{rss} KiB resident for 32 KiB written"
