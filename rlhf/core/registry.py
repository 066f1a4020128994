"""The stages, one StageSpec each, in DAG order: the one place that says what a stage is.

The plan, each stage's inputs (and so its content key), the CLI's and report's stage lists, the work
pools, preflight and the memory estimate all derive from SPECS. A new stage is a module under stages/
with a `run(stage_cfg, ctx)` plus one entry here and its config section (docs/architecture.md).

A spec declares what the stage reads from earlier stages, by role (`ctx.inputs.<role>`, rlhf/core/stage.py),
and the artifacts it writes, with the Parquet schema of each table (rlhf/core/tables.py): writers and readers
both take the schema from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

if TYPE_CHECKING:
    from rlhf.core.config import PipelineConfig  # noqa: F401 (annotations)
    import pyarrow as pa

    from rlhf.core.store import ArtifactStore

# trainer: a TRL Trainer step over rows; rl: our RL loop (generate, score, update); inference: forward passes only
Kind = Literal["trainer", "rl", "inference"]
# model: a from_pretrained folder; table: one Parquet file; tables: a folder of Parquet files of one schema;
# folder: a cache entry; file: anything else (a Markdown leaderboard, a chart)
ArtifactKind = Literal["model", "table", "tables", "folder", "file"]
# What a stage reads, by role: `start` the model a training stage starts from (and its reference policy),
# `policy` the one a sampling stage samples, `pairs` on-policy preference pairs, `ref_logps` their cached
# reference log-probs, `reward_model`, and for eval `policies` (the stages it rates) and `reference` (the policy
# its log-ratios are measured against). A role the config leaves out reads the base model, or the user's or
# the task's data.
ROLES = ("start", "policy", "pairs", "ref_logps", "reward_model", "reference", "policies")
Roles = dict  # role -> stage name ('policies': a list of names); another run's stage is '<run>/<stage>'


@dataclass(frozen=True)
class Artifact:
    name: str  # the key of the manifest's `outputs`
    kind: ArtifactKind
    table: str = ""  # a table's (or each of a folder's tables') schema: its name in rlhf/core/tables.py BY_NAME
    optional: bool = False  # written only under some configs
    root: bool = False  # stored relative to the store root (a cache shared across runs), not the stage's prefix

    @property
    def schema(self) -> pa.Schema | None:
        from rlhf.core.tables import BY_NAME

        return BY_NAME[self.table] if self.table else None


@dataclass(frozen=True)
class StageSpec:
    name: str
    kind: Kind
    inputs: Callable[[PipelineConfig], Roles]  # the stages whose outputs it reads under this config, by role
    outputs: tuple[Artifact, ...]
    shared: tuple[str, ...] = ()  # other config sections that change its outputs (part of its content key)
    usual_lr: tuple[float, float] | None = None  # preflight warns outside this learning-rate range
    # the user data files it reads under this config: `data.<key>` -> the rows' kind (rlhf/data/userdata.py);
    # their contents are part of its key, and preflight checks their rows
    data_files: Callable[[PipelineConfig], dict[str, str]] = lambda cfg: {}
    # the user functions ('module:function') it calls under this config: their source is part of its key
    functions: Callable[[PipelineConfig], list[str]] = lambda cfg: []
    # other models it loads besides the base model and its inputs' (hub ids or local folders): their weights
    # are part of its key
    models: Callable[[PipelineConfig], list[str]] = lambda cfg: []

    @property
    def module(self) -> str:
        return f"stages.{self.name}"

    def output(self, name: str) -> Artifact:
        for a in self.outputs:
            if a.name == name:
                return a
        raise KeyError(f"stage {self.name!r} declares no output {name!r} (rlhf/core/registry.py)")

    def table_schema(self, name: str) -> pa.Schema:
        schema = self.output(name).schema
        if schema is None:
            raise KeyError(f"output {name!r} of stage {self.name!r} is a {self.output(name).kind}, not a table")
        return schema

    def output_problems(self, outputs: dict[str, str]) -> list[str]:
        """What is wrong with a stage's outputs against this declaration: an undeclared name, or a required
        one missing."""
        names = {a.name for a in self.outputs}
        return ([f"output {n!r} is not declared" for n in sorted(set(outputs) - names)]
                + [f"output {a.name!r} is missing" for a in self.outputs if not a.optional and a.name not in outputs])


def _start(cfg) -> Roles:
    # SFT's model when that stage runs, else the base model
    return {"start": "sft"} if cfg.sft.enabled else {}


def _pairs(cfg) -> Roles:
    # the pair-trained stages read the on-policy pairs when that stage runs (else the task's or the user's)
    return {"pairs": "preferences"} if cfg.preferences.enabled else {}


def _rl_inputs(name: str) -> Callable:
    def inputs(cfg) -> Roles:
        rl = cfg.stage(name)
        rm = rl.uses_reward_model() or getattr(rl, "critic_init", "") == "reward_model"
        start = _start(cfg) if rl.init_from == "sft" else {"start": rl.init_from}
        return {**start, **({"reward_model": "reward_model"} if rm else {})}
    return inputs


def _sft_data(cfg) -> dict[str, str]:
    # demonstrations from data.sft_path, else from the prompts file (and its held-out prompts for accuracy)
    return {"sft_path": "sft"} if cfg.data.sft_path else _prompts_data(cfg)


def _pairs_data(cfg) -> dict[str, str]:
    # a preference file is read where the on-policy pairs stage does not run (the config refuses both)
    return {"prefs_path": "prefs"} if cfg.data.prefs_path and not cfg.preferences.enabled else {}


def _kto_data(cfg) -> dict[str, str]:
    return {**({"unpaired_path": "unpaired"} if cfg.data.unpaired_path else _pairs_data(cfg)), **_prompts_data(cfg)}


def _judge_function(cfg) -> list[str]:
    return [cfg.preferences.reward_function] if cfg.preferences.reward_function else []


def _user_environment(env) -> list[str]:
    """An environment class of the user's ('module:Class'; the built-ins are the project's code)."""
    return [env.name] if env is not None and ":" in env.name else []


def _reward_functions(name: str) -> Callable:
    def found(cfg) -> list[str]:  # the user's code the stage calls: reward functions, an environment class
        return ([r.function for r in cfg.stage(name).reward_specs() if r.function]
                + _user_environment(cfg.stage(name).environment))
    return found


def _prompts_data(cfg) -> dict[str, str]:
    """The user's prompts file(s), read by every stage that samples, scores or measures on prompts."""
    return {k: "prompts" for k in ("prompts_path", "eval_prompts_path") if getattr(cfg.data, k)}


def _eval_inputs(cfg) -> Roles:
    from rlhf.core.config import policy_kind

    # this run's stages and other runs' ('<run>/<stage>', same store); base and model: policies are no stage's
    policies = [p for p in cfg.eval.policies if policy_kind(p) in ("stage", "run")]
    judge = {"reward_model": "reward_model"} if cfg.reward_model.enabled else {}  # scores samples even as a metric only
    return {"policies": policies, **({"reference": "sft"} if cfg.sft.enabled else {}), **judge}


def locate(run: str, name: str) -> tuple[str, str]:
    """(run, stage) of an input: a stage of this run, or '<run>/<stage>', another run's in the same store."""
    other, _, stage = name.rpartition("/")
    return (other or run, stage)


POLICY = (Artifact("model", "model"), Artifact("metrics", "table", "metrics"))
SPECS: dict[str, StageSpec] = {s.name: s for s in (
    StageSpec("sft", "trainer", lambda cfg: {}, POLICY, usual_lr=(1e-6, 2e-4),  # TRL SFT examples 2e-5 .. 2e-4
              data_files=_sft_data),
    StageSpec("preferences", "inference", lambda cfg: {"policy": "sft"} if cfg.preferences.policy == "sft" else {},
              (Artifact("pairs", "table", "pairs"), Artifact("eval_pairs", "table", "pairs"),
               Artifact("samples", "table", "preference_samples"),
               Artifact("contrast_pairs", "table", "pairs", optional=True)),  # contrast_samples > 0
              functions=_judge_function, data_files=_prompts_data),
    StageSpec("reward_model", "trainer",
              lambda cfg: {**({"start": "sft"} if cfg.reward_model.init_from == "sft" else {}), **_pairs(cfg)}, POLICY,
              usual_lr=(1e-6, 1e-4), data_files=_pairs_data),  # InstructGPT RM 9e-6; TRL reward example 1e-5 .. 1e-4
    # the reference is the policy DPO starts from: SFT when it runs, else the base model
    StageSpec("ref_logprobs", "inference", lambda cfg: {**_start(cfg), **_pairs(cfg)},
              (Artifact("ref_logps", "table", "ref_logps"), Artifact("cache_entry", "folder", root=True)),
              data_files=_pairs_data),
    StageSpec("dpo", "trainer", lambda cfg: {**_start(cfg), **_pairs(cfg), "ref_logps": "ref_logprobs"}, POLICY,
              usual_lr=(1e-7, 5e-5),  # Rafailov et al. 2023: 1e-6; Zephyr 5e-7
              data_files=lambda cfg: {**_pairs_data(cfg), **_prompts_data(cfg)}),  # prompts: held-out accuracy, later rounds
    # KTO keeps its own reference cache (stages/kto.py says why)
    StageSpec("kto", "trainer", lambda cfg: {**_start(cfg), **_pairs(cfg)},
              (*POLICY, Artifact("ref_logps", "table", "kto_ref_logps"), Artifact("cache_entry", "folder", root=True)),
              usual_lr=(1e-7, 5e-5),  # Ethayarajh et al. 2024: 5e-7 .. 5e-6
              data_files=_kto_data),
    # the RL loop samples with the rollout settings: that section is part of their keys
    StageSpec("ppo", "rl", _rl_inputs("ppo"), (*POLICY, Artifact("experience", "tables", "experience")),
              shared=("rollout",), usual_lr=(1e-7, 2e-5),  # Ouyang et al. 2022: 9.65e-6 (1.3B)
              functions=_reward_functions("ppo"), data_files=_prompts_data),
    StageSpec("grpo", "rl", _rl_inputs("grpo"), (*POLICY, Artifact("experience", "tables", "experience")),
              shared=("rollout",), usual_lr=(1e-7, 2e-5),  # DeepSeekMath: 1e-6
              functions=_reward_functions("grpo"), data_files=_prompts_data),
    StageSpec("rollout", "inference", lambda cfg: {} if cfg.rollout.policy == "base" else {"policy": cfg.rollout.policy},
              (Artifact("rollouts", "table", "rollouts"),), data_files=_prompts_data),
    StageSpec("eval", "inference", _eval_inputs,
              (*(Artifact(n, "table", f"eval.{n}") for n in ("samples", "battles", "ratings", "metrics", "accuracy_diffs", "run")),
               Artifact("leaderboard", "file"), Artifact("chart", "file")),
              data_files=_prompts_data, functions=lambda cfg: _user_environment(cfg.eval.environment),
              models=lambda cfg: [p.removeprefix("model:") for p in cfg.eval.policies if p.startswith("model:")]),
)}
NAMES = tuple(SPECS)  # DAG order: every stage's inputs come before it


def of_kind(kind: Kind) -> tuple[str, ...]:
    return tuple(n for n, s in SPECS.items() if s.kind == kind)


def role_stages(roles: Roles) -> list[str]:
    """Every stage named in a role mapping, once: this run's in DAG order, then other runs' ('<run>/<stage>')."""
    names = {s for v in roles.values() for s in ([v] if isinstance(v, str) else v)}
    return sorted(names & set(NAMES), key=NAMES.index) + sorted(names - set(NAMES))


def stage_inputs(cfg: PipelineConfig, stage: str) -> list[str]:
    """The stages whose outputs `stage` reads (their keys are part of its content key)."""
    return role_stages(SPECS[stage].inputs(cfg))


def plan(cfg: PipelineConfig) -> list[str]:
    """Enabled stages in DAG order. Their inputs are enabled too: PipelineConfig._cross refuses, naming the
    key, every config where an enabled stage would read a disabled one."""
    return [s for s in NAMES if cfg.stage(s).enabled]


def output_path(store: ArtifactStore, run: str, stage: str, name: str, rel: str) -> str:
    """Where a manifest's output lives: in the stage's prefix, or (shared caches) under the store root."""
    return store.path(rel) if SPECS[stage].output(name).root else store.stage_path(run, stage, rel)
