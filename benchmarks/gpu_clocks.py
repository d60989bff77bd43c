"""The GPU's SM clock, power draw and clock-event reasons, sampled by `nvidia-smi -lms` in the
background while benchmarks/kernel.py times the forward.

Run back to back, the forward reaches the H200's 700 W software power cap from M = 16 up (SM
clock ~1550-1650 MHz instead of 1980; the device copy stays at 1980 MHz and ~480 W), so a
timing is only comparable with another at the clock it ran at.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time

FIELDS = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"

# nvidia-smi's clocks_event_reasons bits (nvmlClocksEventReasons)
REASONS = {
    0x1: "idle",
    0x2: "app_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clock",
}


class Sampler:
    """nvidia-smi -lms in the background; samples kept with their arrival time."""

    def __init__(self, period_ms: int) -> None:
        self.samples: list[tuple[float, list[str]]] = []
        self.proc = subprocess.Popen(
            [
                "nvidia-smi",
                f"--query-gpu={FIELDS}",
                "--format=csv,noheader,nounits",
                f"-lms={period_ms}",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.samples.append((time.monotonic(), [f.strip() for f in line.split(",")]))

    def window(self, t0: float, t1: float) -> dict:
        """Medians (and the minimum SM clock) of the samples that arrived between t0 and t1
        (time.monotonic), with every clock-event reason seen; {"samples": 0} if none did."""
        rows = [s for t, s in self.samples if t0 <= t <= t1]

        def col(i: int) -> list[float]:
            out = []
            for r in rows:
                with contextlib.suppress(ValueError, IndexError):
                    out.append(float(r[i]))
            return sorted(out)

        sm = col(0)
        if not sm:
            return {"samples": 0}
        reasons = 0
        for r in rows:
            with contextlib.suppress(ValueError, IndexError):
                reasons |= int(r[4], 16)

        def med(i: int) -> float:
            v = col(i)
            return v[len(v) // 2] if v else float("nan")

        return {
            "samples": len(rows),
            "sm_mhz_median": sm[len(sm) // 2],
            "sm_mhz_min": sm[0],
            "mem_mhz_median": med(1),
            "power_w_median": med(2),
            "temp_c_median": med(3),
            "reasons_mask": hex(reasons),
            "reasons": [name for bit, name in REASONS.items() if reasons & bit],
        }

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=5)


def start_sampler(period_ms: int = 25) -> Sampler | None:
    """A Sampler, or None where nvidia-smi is missing (the timings do not depend on it)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        return Sampler(period_ms)
    except OSError:
        return None
