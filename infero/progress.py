"""A progress bar on stderr for things users wait for (loading weights, compiling kernels).

Drawn in place on a terminal; on a pipe or file it prints nothing until the final line, so logs stay clean.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int, unit: str = "B", stream=None, enabled: bool = True):
        self.label, self.total, self.unit = label, max(total, 1), unit
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and getattr(self.stream, "isatty", lambda: False)()
        self.done, self.start, self._last_draw = 0, time.monotonic(), 0.0

    def __call__(self, amount: int) -> None:
        self.done += amount
        now = time.monotonic()
        if self.tty and (now - self._last_draw > 0.05 or self.done >= self.total):
            self._last_draw = now
            self._draw()

    def _draw(self) -> None:
        frac = min(self.done / self.total, 1.0)
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        amount = (
            f"{self.done / 2**20:,.0f}/{self.total / 2**20:,.0f} MiB"
            if self.unit == "B"
            else f"{self.done}/{self.total}"
        )
        self.stream.write(f"\r{self.label} [{bar}] {frac:4.0%} {amount}")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
