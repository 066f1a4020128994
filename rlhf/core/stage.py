"""What a stage's `run(stage_cfg, ctx)` receives and returns; the runner builds one and records the other."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from rlhf.core.config import PipelineConfig
from rlhf.core.manifest import Manifest
from rlhf.core.store import ArtifactStore


@dataclass
class StageResult:
    outputs: dict[str, str]  # artifact name -> path relative to the stage prefix (or to the store root: see ROOT_OUTPUTS)
    rows: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    resumed_from_step: int | None = None


@dataclass(frozen=True)
class StageContext:
    cfg: PipelineConfig
    store: ArtifactStore
    stage: str
    key: str
    inputs: dict[str, Manifest]  # input stage -> its manifest
    workdir: Path  # local scratch, keyed by content key; safe to delete
    log: logging.Logger

    def path(self, *rest: str) -> str:
        return self.store.stage_path(self.cfg.run.name, self.stage, *rest)

    def input_path(self, stage: str, output: str) -> str:
        """Where an input's output lives: this run's stage, or ('<run>/<stage>') another run's."""
        from rlhf.core.registry import locate

        return self.store.stage_path(*locate(self.cfg.run.name, stage), self.inputs[stage]["outputs"][output])
