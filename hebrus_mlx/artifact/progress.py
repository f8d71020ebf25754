"""A small stderr progress bar with bytes/s and ETA (convert, verify)."""

import sys
import time


class Progress:
    def __init__(self, label, total, stream=None, min_interval=0.2):
        self.label, self.total, self.done = label, max(int(total), 1), 0
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = self.last = time.monotonic()
        self.min_interval = min_interval

    def __call__(self, n):
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.min_interval:
            self.last = now
            self.draw(now)

    def draw(self, now):
        elapsed = max(now - self.t0, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        self.stream.write(
            f"\r{self.label:<18} [{bar:<30}] {frac:6.1%} {self.done / 2**20:9.1f} MiB "
            f"{rate / 2**20:7.1f} MiB/s ETA {eta:5.0f}s"
        )
        self.stream.flush()

    def close(self):
        self.draw(time.monotonic())
        self.stream.write("\n")
        self.stream.flush()
