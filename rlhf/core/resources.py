"""Peak resident memory of one stage, for its manifest.

`resource.getrusage(...).ru_maxrss` is the lifetime peak of a process, so in-process stages run one after
another would all report the largest so far. A sampler thread reads the RSS of this process plus its
children (a launched stage's ranks) every `interval` seconds and keeps the maximum: the peak seen while
the stage ran, including what the process already held when it started (reported as `start_rss_mb`).
"""

from __future__ import annotations

import threading

import psutil


def _rss(proc: psutil.Process) -> int:
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:  # exited between listing and reading
            pass
    return total


class PeakRSS:
    def __init__(self, interval: float = 0.2):
        self.interval, self.peak, self.start = interval, 0, 0
        self._stop = threading.Event()
        self._proc = psutil.Process()
        self._thread = threading.Thread(target=self._sample, name="rlhf-peak-rss", daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss(self._proc))
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = _rss(self._proc)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss(self._proc))

    def figures(self) -> dict[str, float]:
        return {"peak_rss_mb": round(self.peak / 2**20, 1), "start_rss_mb": round(self.start / 2**20, 1)}
