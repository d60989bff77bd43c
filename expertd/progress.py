"""Progress of long start-up work (loading and repacking layers, capturing CUDA
graphs): a live bar on a terminal, log lines otherwise.

    bar = Progress("loading experts", total=60, log=log)
    for n, layer in enumerate(layers, 1):
        ...
        bar.update(n, f"loaded layer {layer}")
    bar.close()

On a terminal (stderr is a tty) one line is redrawn in place:

    loading experts [########--------------]  22/60 layers  31.0 s  ~53 s left  loaded layer 21

Otherwise each update is a log line (the first, the last, and at most one per
`every_s` between them), so a container's log shows how far it got:

    loaded layer 21 [22/60 layers, 31.0 s, ~53 s left]
"""

from __future__ import annotations

import logging
import sys
import time

BAR = 22  # characters of the bar


class Progress:
    def __init__(
        self,
        what: str,
        total: int,
        *,
        unit: str = "layers",
        log: logging.Logger | None = None,
        stream=None,
        every_s: float = 5.0,
    ) -> None:
        self.what, self.total, self.unit = what, max(total, 0), unit
        self.log = log or logging.getLogger("expertd")
        self.stream = sys.stderr if stream is None else stream
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = every_s
        self.start = time.perf_counter()
        self._logged = -float("inf")  # perf_counter of the last log line
        self._drawn = False

    def _figures(self, done: int) -> str:
        elapsed = time.perf_counter() - self.start
        text = f"{done}/{self.total} {self.unit}, {elapsed:.1f} s"
        if 0 < done < self.total:
            text += f", ~{elapsed / done * (self.total - done):.0f} s left"
        return text

    def update(self, done: int, detail: str = "") -> None:
        """`done` of `total` finished; `detail` says what the last one was."""
        if self.live:
            filled = BAR * done // self.total if self.total else BAR
            bar = "#" * filled + "-" * (BAR - filled)
            figures = self._figures(done).replace(", ", "  ")
            self.stream.write(f"\r\033[K{self.what} [{bar}] {figures}  {detail}")
            self.stream.flush()
            self._drawn = True
            return
        now = time.perf_counter()
        if done <= 1 or done >= self.total or now - self._logged >= self.every_s:
            self._logged = now
            self.log.info("%s [%s]", detail or self.what, self._figures(done))

    def close(self) -> None:
        """End the live line (nothing to do for log lines)."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
