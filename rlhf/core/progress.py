"""Stage progress as a fraction, for whoever listens. Stages stay Prefect-free: their loops call `report`
next to their rate/ETA log line, and nothing happens unless a listener is set; the Prefect flow sets one
that keeps a progress artifact per stage run up to date, so the UI shows how far a stage is.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

_listener: Callable[[str, float], None] | None = None


def report(stage: str, done: float, total: float) -> None:
    if _listener is not None and total > 0:
        _listener(stage, min(max(done / total, 0.0), 1.0))


@contextmanager
def listening(fn: Callable[[str, float], None]):
    global _listener
    previous, _listener = _listener, fn
    try:
        yield
    finally:
        _listener = previous
