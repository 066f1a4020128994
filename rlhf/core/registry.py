"""The stages, one StageSpec each, in DAG order: the one place that says what a stage is.

The plan, each stage's inputs (and so its content key), the CLI's and report's stage lists, the work
pools, preflight and the memory estimate all derive from SPECS. A new stage is a module under stages/
with a `run(stage_cfg, ctx)` plus one entry here and its config section (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

if TYPE_CHECKING:
    from rlhf.core.config import PipelineConfig  # noqa: F401 (annotations)
    from rlhf.core.store import ArtifactStore

# trainer: a TRL Trainer step over rows; rl: our RL loop (generate, score, update); inference: forward passes only
Kind = Literal["trainer", "rl", "inference"]


@dataclass(frozen=True)
class StageSpec:
    name: str
    kind: Kind
    inputs: Callable[[PipelineConfig], list[str]]  # the stages whose outputs it reads under this config
    outputs: tuple[str, ...]  # the artifact names of its manifest
    optional_outputs: tuple[str, ...] = ()  # names its manifest has only under some configs
    root_outputs: tuple[str, ...] = ()  # those stored relative to the store root (shared caches), not the stage
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


def _sft(cfg) -> list[str]:
    return ["sft"] if cfg.sft.enabled else []


def _pairs(cfg) -> list[str]:
    # the pair-trained stages read the on-policy pairs when that stage runs (else the task's or the user's)
    return ["preferences"] if cfg.preferences.enabled else []


def _rl_inputs(name: str) -> Callable:
    def inputs(cfg) -> list[str]:
        rl = cfg.stage(name)
        rm = rl.uses_reward_model() or getattr(rl, "critic_init", "") == "reward_model"
        start = [] if rl.init_from == "sft" else [rl.init_from]
        return sorted({*_sft(cfg), *start, *(["reward_model"] if rm else [])}, key=NAMES.index)
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


def _reward_functions(name: str) -> Callable:
    return lambda cfg: [r.function for r in cfg.stage(name).reward_specs() if r.function]


def _prompts_data(cfg) -> dict[str, str]:
    """The user's prompts file(s), read by every stage that samples, scores or measures on prompts."""
    return {k: "prompts" for k in ("prompts_path", "eval_prompts_path") if getattr(cfg.data, k)}


def _eval_inputs(cfg) -> list[str]:
    from rlhf.core.config import policy_kind

    policies = [p for p in cfg.eval.policies if policy_kind(p) == "stage"]
    judge = ["reward_model"] if cfg.reward_model.enabled else []  # scores samples even as a metric only
    others = sorted(p for p in cfg.eval.policies if policy_kind(p) == "run")  # other runs' stages, same store
    return sorted({*policies, *_sft(cfg), *judge}, key=NAMES.index) + others


def locate(run: str, name: str) -> tuple[str, str]:
    """(run, stage) of an input: a stage of this run, or '<run>/<stage>', another run's in the same store."""
    other, _, stage = name.rpartition("/")
    return (other or run, stage)


POLICY = ("model", "metrics")
SPECS: dict[str, StageSpec] = {s.name: s for s in (
    StageSpec("sft", "trainer", lambda cfg: [], POLICY, usual_lr=(1e-6, 2e-4),  # TRL SFT examples 2e-5 .. 2e-4
              data_files=_sft_data),
    StageSpec("preferences", "inference", lambda cfg: [] if cfg.preferences.policy == "base" else ["sft"],
              ("pairs", "eval_pairs", "samples"), optional_outputs=("contrast_pairs",),  # contrast_samples > 0
              functions=_judge_function, data_files=_prompts_data),
    StageSpec("reward_model", "trainer",
              lambda cfg: [*(["sft"] if cfg.reward_model.init_from == "sft" else []), *_pairs(cfg)], POLICY,
              usual_lr=(1e-6, 1e-4), data_files=_pairs_data),  # InstructGPT RM 9e-6; TRL reward example 1e-5 .. 1e-4
    # the reference is the policy DPO starts from: SFT when it runs, else the base model
    StageSpec("ref_logprobs", "inference", lambda cfg: [*_sft(cfg), *_pairs(cfg)], ("ref_logps", "cache_entry"),
              root_outputs=("cache_entry",), data_files=_pairs_data),
    StageSpec("dpo", "trainer", lambda cfg: [*_sft(cfg), *_pairs(cfg), "ref_logprobs"], POLICY,
              usual_lr=(1e-7, 5e-5),  # Rafailov et al. 2023: 1e-6; Zephyr 5e-7
              data_files=lambda cfg: {**_pairs_data(cfg), **_prompts_data(cfg)}),  # prompts: held-out accuracy, later rounds
    # KTO keeps its own reference cache (stages/kto.py says why)
    StageSpec("kto", "trainer", lambda cfg: [*_sft(cfg), *_pairs(cfg)], (*POLICY, "ref_logps", "cache_entry"),
              root_outputs=("cache_entry",), usual_lr=(1e-7, 5e-5),  # Ethayarajh et al. 2024: 5e-7 .. 5e-6
              data_files=_kto_data),
    # the RL loop samples with the rollout settings: that section is part of their keys
    StageSpec("ppo", "rl", _rl_inputs("ppo"), (*POLICY, "experience"), shared=("rollout",),
              usual_lr=(1e-7, 2e-5), functions=_reward_functions("ppo"), data_files=_prompts_data),  # Ouyang et al. 2022: 9.65e-6 (1.3B)
    StageSpec("grpo", "rl", _rl_inputs("grpo"), (*POLICY, "experience"), shared=("rollout",),
              usual_lr=(1e-7, 2e-5), functions=_reward_functions("grpo"), data_files=_prompts_data),  # DeepSeekMath: 1e-6
    StageSpec("rollout", "inference", lambda cfg: [] if cfg.rollout.policy == "base" else [cfg.rollout.policy],
              ("rollouts",), data_files=_prompts_data),
    StageSpec("eval", "inference", _eval_inputs,
              ("samples", "battles", "ratings", "metrics", "accuracy_diffs", "run", "leaderboard", "chart"),
              data_files=_prompts_data,
              models=lambda cfg: [p.removeprefix("model:") for p in cfg.eval.policies if p.startswith("model:")]),
)}
NAMES = tuple(SPECS)  # DAG order: every stage's inputs come before it


def of_kind(kind: Kind) -> tuple[str, ...]:
    return tuple(n for n, s in SPECS.items() if s.kind == kind)


def stage_inputs(cfg: PipelineConfig, stage: str) -> list[str]:
    """The stages whose outputs `stage` reads (their keys are part of its content key)."""
    return SPECS[stage].inputs(cfg)


def plan(cfg: PipelineConfig) -> list[str]:
    """Enabled stages in DAG order. Their inputs are enabled too: PipelineConfig._cross refuses, naming the
    key, every config where an enabled stage would read a disabled one."""
    return [s for s in NAMES if cfg.stage(s).enabled]


def output_path(store: ArtifactStore, run: str, stage: str, name: str, rel: str) -> str:
    """Where a manifest's output lives: in the stage's prefix, or (shared caches) under the store root."""
    return store.path(rel) if name in SPECS[stage].root_outputs else store.stage_path(run, stage, rel)
