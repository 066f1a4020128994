"""Stage progress as a fraction, for whoever listens. Stages stay Prefect-free: their loops call `report`
next to their rate/ETA log line, and nothing happens unless a listener is set; the Prefect flow sets one
that keeps a progress artifact per stage run up to date, so the UI shows how far a stage is.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

_listener: Callable[[str, float], None] | None = None
_stage: str | None = None


def report(stage: str, done: float, total: float) -> None:
    if _listener is not None and total > 0:
        _listener(stage, min(max(done / total, 0.0), 1.0))


def current_stage() -> str | None:
    """The stage whose run is being listened to (for messages about the whole run), or None."""
    return _stage


@contextmanager
def listening(fn: Callable[[str, float], None], stage: str | None = None):
    global _listener, _stage
    previous, _listener, previous_stage, _stage = _listener, fn, _stage, stage
    try:
        yield
    finally:
        _listener, _stage = previous, previous_stage
