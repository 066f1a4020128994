"""What a stage's `run(stage_cfg, ctx)` receives and returns; the runner builds one and records the other."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf.core.config import PipelineConfig
from rlhf.core.manifest import Manifest
from rlhf.core.registry import ROLES, SPECS, Roles, locate, role_stages
from rlhf.core.store import ArtifactStore

if TYPE_CHECKING:
    import pyarrow as pa


@dataclass
class StageResult:
    outputs: dict[str, str]  # artifact name -> path relative to the stage prefix (or to the store root: Artifact.root)
    rows: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    resumed_from_step: int | None = None


@dataclass(frozen=True)
class Input:
    """An earlier stage's completed manifest, as a stage reads it."""
    stage: str  # this run's stage, or '<run>/<stage>' (another run's, same store)
    manifest: Manifest

    @property
    def key(self) -> str:
        return self.manifest["key"]

    @property
    def spec_name(self) -> str:
        return locate("", self.stage)[1]

    def has(self, output: str) -> bool:
        return output in self.manifest["outputs"]


@dataclass(frozen=True)
class Inputs:
    """A stage's inputs by role, as its spec declares them for this config (rlhf/core/registry.py ROLES says
    what each role is). A role the config leaves out is None (`policies`: empty), and the stage reads the base
    model or the user's or the task's data instead."""
    start: Input | None = None
    policy: Input | None = None
    pairs: Input | None = None
    ref_logps: Input | None = None
    reward_model: Input | None = None
    reference: Input | None = None
    policies: tuple[Input, ...] = ()

    @classmethod
    def build(cls, roles: Roles, manifests: dict[str, Manifest]) -> Inputs:
        unknown = set(roles) - set(ROLES)
        if unknown:  # a registry entry naming a role no stage can read
            raise ValueError(f"unknown input roles {sorted(unknown)}; roles are {', '.join(ROLES)}")
        one = {r: Input(s, manifests[s]) for r, s in roles.items() if isinstance(s, str)}
        many = {r: tuple(Input(s, manifests[s]) for s in v) for r, v in roles.items() if not isinstance(v, str)}
        return cls(**one, **many)

    def roles(self) -> Roles:
        out: Roles = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Input):
                out[f.name] = value.stage
            elif value:
                out[f.name] = [i.stage for i in value]
        return out

    def by_stage(self) -> dict[str, Input]:
        """Every input once, by stage name: this run's in DAG order, then other runs'."""
        found = {i.stage: i for f in fields(self) for i in _as_tuple(getattr(self, f.name))}
        return {s: found[s] for s in role_stages(self.roles())}

    def keys(self) -> dict[str, str]:
        """Stage name -> content key: the `inputs` part of the stage's identity."""
        return {s: i.key for s, i in self.by_stage().items()}

    def named(self, stage: str) -> Input:
        try:
            return self.by_stage()[stage]
        except KeyError:
            raise KeyError(f"{stage!r} is not an input of this stage (its inputs: {sorted(self.by_stage())})") from None

    def to_json(self) -> dict[str, Any]:
        """For a launched stage's ranks (rlhf/pipeline/rank.py), which rebuild it with from_json."""
        return {"roles": self.roles(), "manifests": {s: i.manifest for s, i in self.by_stage().items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Inputs:
        return cls.build(data["roles"], data["manifests"])


def _as_tuple(value: Input | tuple[Input, ...] | None) -> tuple[Input, ...]:
    return (value,) if isinstance(value, Input) else tuple(value or ())


@dataclass(frozen=True)
class StageContext:
    cfg: PipelineConfig
    store: ArtifactStore
    stage: str
    key: str
    inputs: Inputs
    workdir: Path  # local scratch, keyed by content key; safe to delete
    log: logging.Logger

    def path(self, *rest: str) -> str:
        return self.store.stage_path(self.cfg.run.name, self.stage, *rest)

    def input_path(self, source: Input, output: str) -> str:
        """Where an input's output lives: this run's stage, or ('<run>/<stage>') another run's."""
        return self.store.stage_path(*locate(self.cfg.run.name, source.stage), source.manifest["outputs"][output])

    def read_input(self, source: Input, output: str) -> pa.Table:
        """An input's table, checked against the schema its stage declares."""
        return self.store.read_table(self.input_path(source, output), SPECS[source.spec_name].table_schema(output))

    def write_output(self, output: str, rows: list[dict] | pa.Table, rel: str | None = None) -> str:
        """Writes one of this stage's declared tables (`<output>.parquet` unless `rel`) with its declared schema;
        returns the path relative to the stage prefix, for StageResult.outputs."""
        import pyarrow as pa

        schema = SPECS[self.stage].table_schema(output)
        table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows, schema=schema)
        rel = rel or f"{output}.parquet"
        self.store.write_table(self.path(rel), table, schema)
        return rel
