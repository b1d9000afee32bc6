"""Progress of a long command on stderr: at most one line every `INTERVAL_S` seconds, with the time left estimated
from the steps done so far; silent when stderr is not a terminal unless asked for (`--progress`), so logs and
pipes get only the result. No dependency: `kvx calibrate-kv` runs for minutes on a CPU, and tqdm is the demo's."""
from __future__ import annotations

import sys
import time
from typing import TextIO

INTERVAL_S = 5.0


def _duration(seconds: float) -> str:
    """`42 s`, `3 min 5 s`, `1 h 2 min`: coarse enough for an estimate."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


class Progress:
    """`total` steps of `what`; `step(label)` after each. The first step prints at once (it shows the rate), later
    ones at most every `interval` seconds; the estimate assumes the remaining steps take as long as the done ones."""

    def __init__(self, what: str, total: int, *, enabled: bool | None = None, stream: TextIO | None = None,
                 interval: float = INTERVAL_S) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.what, self.total, self.interval = what, total, interval
        self.done = 0
        self.start = time.monotonic()
        self.last: float | None = None

    def step(self, label: str = "") -> None:
        self.done += 1
        now = time.monotonic()
        if not self.enabled or (self.last is not None and now - self.last < self.interval and self.done < self.total):
            return
        self.last = now
        elapsed = now - self.start
        left = elapsed / self.done * (self.total - self.done)
        print(f"{self.what}: {self.done}/{self.total}{f' ({label})' if label else ''}, {_duration(elapsed)} "
              f"elapsed, ~{_duration(left)} left", file=self.stream, flush=True)
