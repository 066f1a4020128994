"""Experiment trackers: the curves where people look while a stage trains.

The store keeps every number anyway (each stage's metrics table, its manifest); a tracker mirrors them as
they are logged. One tracker per stage attempt, in the process that runs the stage (rank 0 of a
multi-process stage): the runner logs the config, content key and inputs when the stage starts and the
final metrics and output URLs when it ends; the Trainer stages log every Trainer log line
(rlhf/train/training.py), the RL loop every iteration (rlhf/train/rl_loop.py).

Backends (tracking.backends):
  tensorboard  event files written under the stage's scratch folder, uploaded to `<stage>/tensorboard/` in
               the store when the stage ends. A resumed stage finds its earlier attempt's event files in
               the same scratch folder (it is keyed by the content key) and continues their curves: one
               run per stage in TensorBoard, not two.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# backend -> the module it needs, and how to get it
NEEDS = {"tensorboard": ("tensorboard", "pip install tensorboard (or the [tracking] extra)")}
FOLDER = "tensorboard"


def backend_problems(backends: list[str]) -> list[str]:
    """'tracking.backends: ...' lines for backends this environment cannot run (checked before any work)."""
    out = []
    for name in backends:
        module, how = NEEDS[name]
        if importlib.util.find_spec(module) is None:
            out.append(f"tracking.backends: {name!r} needs the {module} package, which is not installed: {how}")
    return out


class Tracker:
    """Writes to every configured backend; with none, every call does nothing."""

    def __init__(self, backends: list[str], logdir: Path):
        self.tb = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            logdir.mkdir(parents=True, exist_ok=True)
            self.tb = SummaryWriter(str(logdir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Scalars at one step; values that are not finite numbers are skipped (NaN has no curve)."""
        if self.tb is None:
            return
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.tb.add_scalar(name, float(value), step)
        self.tb.flush()

    def text(self, tag: str, value: dict) -> None:
        """A record (config, keys, outputs) as JSON text."""
        if self.tb is not None:
            self.tb.add_text(tag, "```\n" + json.dumps(value, indent=2, sort_keys=True, default=str) + "\n```")
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


NULL = Tracker([], Path("."))
_current: Tracker = NULL


def current() -> Tracker:
    """This process's tracker for the running stage (a no-op one outside a stage or on ranks > 0)."""
    return _current


@contextmanager
def stage_tracker(backends: list[str], logdir: Path) -> Iterator[Tracker]:
    """Makes a tracker this process's current one for the duration of a stage."""
    global _current
    tracker = Tracker(backends, logdir)
    previous, _current = _current, tracker
    try:
        yield tracker
    finally:
        _current = previous
        tracker.close()
