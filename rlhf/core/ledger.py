"""What a stage cost: wall and CPU seconds, peak memory (RSS; GPU where there is one), the device, the
installed package set (a hash), tokens and samples. Recorded in each manifest's `ledger`, and read back
across runs as the `ledger` view of `rlhf query`.
"""

from __future__ import annotations

import hashlib
import math
import platform
import time
from functools import lru_cache
from importlib.metadata import distributions

import psutil


@lru_cache(maxsize=None)
def packages_hash() -> str:
    """sha256 (16 hex) of the sorted `name==version` of every installed distribution. Once per process (it
    reads ~300 metadata files, 0.4 s, and every stage's ledger asks): the modules a process has loaded are
    the ones it started with, whatever is installed later."""
    names = sorted(f"{d.metadata['Name']}=={d.version}".lower() for d in distributions() if d.metadata["Name"])
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return f"cpu ({platform.machine()}, {psutil.cpu_count()} cores)"


def _cpu_seconds(proc: psutil.Process) -> float:
    """This process's CPU time plus that of its children (reaped ones included) and live descendants."""
    t = proc.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in proc.children(recursive=True):
        try:
            c = child.cpu_times()
            total += c.user + c.system
        except psutil.Error:
            pass
    return total


class Meter:
    """Around one stage run: CPU seconds and (CUDA) peak GPU memory of what ran inside."""

    def __enter__(self) -> Meter:
        import torch

        self._proc = psutil.Process()
        self._cuda = torch.cuda.is_available()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()
        self._cpu0, self._t0 = _cpu_seconds(self._proc), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        import torch

        self.cpu_seconds = _cpu_seconds(self._proc) - self._cpu0
        self.peak_gpu_mb = round(torch.cuda.max_memory_allocated() / 2**20, 1) if self._cuda else None

    def figures(self) -> dict:
        return {"cpu_seconds": round(self.cpu_seconds, 2), "peak_gpu_mb": self.peak_gpu_mb,
                "device": device_name(), "packages_hash": packages_hash()}


def _number(value, kind=float):
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or abs(value) >= 2**62:
        return None  # JSON from a store may hold Infinity, NaN or huge numbers
    return kind(value)


def _text(value) -> str | None:
    return value[:200] if isinstance(value, str) else None


def ledger_row(manifest: dict) -> dict:
    """One ledger row from a manifest read from a (shared) store: every field type-checked, so a
    malformed manifest gives nulls, never an error or an odd type."""
    timings = manifest.get("timings") if isinstance(manifest.get("timings"), dict) else {}
    ledger = manifest.get("ledger") if isinstance(manifest.get("ledger"), dict) else {}
    metrics = manifest.get("metrics") if isinstance(manifest.get("metrics"), dict) else {}
    rows = manifest.get("rows") if isinstance(manifest.get("rows"), dict) else {}
    stage = _text(manifest.get("stage"))
    return {
        "run": _text(manifest.get("run")), "stage": stage, "key": _text(manifest.get("key")),
        "started": _text(timings.get("started")), "finished": _text(timings.get("finished")),
        "resumed_from_step": _number(manifest.get("resumed_from_step"), int),
        "wall_seconds": _number(timings.get("seconds")), "cpu_seconds": _number(ledger.get("cpu_seconds")),
        "peak_rss_mb": _number(timings.get("peak_rss_mb")), "peak_gpu_mb": _number(ledger.get("peak_gpu_mb")),
        "device": _text(ledger.get("device")), "packages_hash": _text(ledger.get("packages_hash")),
        "tokens": _number(metrics.get(f"{stage}/tokens_seen"), int),
        "samples": _number(rows.get("samples"), int),
    }
