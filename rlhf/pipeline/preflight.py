"""What a run will do before it starts: per stage skip / resume / run for this run name (from the predicted
content keys and what is in the store), the memory estimate, and warnings about risky settings.
`rlhf validate` prints it; every run logs it first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlhf.core import cluster, tracking
from rlhf.core.config import PipelineConfig
from rlhf.core.registry import SPECS, locate, of_kind, plan, stage_inputs
from rlhf.pipeline.identity import DATA_FILES, explain, identity, key_of
from rlhf.core.manifest import ManifestError
from rlhf.core.hardware import cpu_has_bf16
from rlhf.core.store import ATTEMPT, endpoint_problem

if TYPE_CHECKING:
    from rlhf.data.sources import PromptSource


def network_problems(cfg: PipelineConfig, timeout: float = 3.0) -> list[str]:
    """Every server the run will reach, asked once each with a timeout, before any work: the S3 endpoint,
    the tracking servers and the Ray clusters. One 'key: problem' line each, naming the address."""
    return ([p for p in [endpoint_problem(cfg.storage, timeout)] if p] + tracking.network_problems(cfg.tracking, timeout)
            + cluster.network_problems(cfg, timeout))


def predicted_identities(cfg: PipelineConfig, store=None) -> dict[str, dict]:
    """Identities the stages will have (rlhf/pipeline/identity.py): each depends only on config, code, data,
    model, packages and its inputs' keys, so the whole plan is known before any stage runs. Another run's
    stage ('<run>/<stage>', an eval policy) is an input whose key is read from its manifest in `store`."""
    idents: dict[str, dict] = {}
    for stage in plan(cfg):
        keys = {s: key_of(idents[s]) if s in idents else external_key(cfg, store, s) for s in stage_inputs(cfg, stage)}
        idents[stage] = identity(cfg, stage, keys)
    return idents


def external_key(cfg: PipelineConfig, store, name: str) -> str:
    """The content key of another run's complete stage; ValueError naming it when there is none."""
    run, stage = locate(cfg.run.name, name)
    manifest = None if store is None else store.read_manifest(run, stage)
    if manifest is None:
        raise ValueError(f"eval.policies: {name!r}: run {run!r} has no complete {stage} stage in the store"
                         + ("" if store is None else f" ({store.url(store.stage_path(run, stage))})"))
    if "model" not in manifest["outputs"]:  # what an evaluated policy is read from
        raise ValueError(f"eval.policies: {name!r}: its manifest lists no model output "
                         f"({store.url(store.stage_path(run, stage))})")
    return manifest["key"]


def policy_problems(cfg: PipelineConfig, store) -> list[str]:
    """'eval.policies: ...' lines for evaluated policies that do not exist: another run's stage without a
    complete manifest in the store, a local model folder that is missing, a hub id neither cached nor known
    to the hub."""
    from pathlib import Path

    from rlhf.core import fingerprint
    from rlhf.core.config import policy_kind

    if not cfg.eval.enabled:
        return []
    out = []
    for p in cfg.eval.policies:
        if policy_kind(p) == "run":
            try:
                external_key(cfg, store, p)
            except ValueError as e:
                out.append(str(e))
        elif policy_kind(p) == "model":
            name = p.removeprefix("model:")
            if name.startswith(("/", ".", "~")):
                if not (Path(name).expanduser() / "config.json").is_file():
                    out.append(f"eval.policies: {p!r}: no model folder there (no config.json)")
            elif fingerprint.hub_revision(name) == "unresolved":
                out.append(f"eval.policies: {p!r}: not in the local Hugging Face cache, and the hub did not answer")
    return out


def predicted_keys(cfg: PipelineConfig, store=None) -> dict[str, str]:
    return {stage: key_of(ident) for stage, ident in predicted_identities(cfg, store).items()}


def outlook(cfg: PipelineConfig, store) -> dict[str, str]:
    """stage -> 'skip (complete, key ...)', 'resume (checkpoints of this key)' or 'run', with what changed
    since the stored result when there is one (a data file, the model's weights, a package, a code file,
    a config value, an upstream stage)."""
    out = {}
    paths = {k: getattr(cfg.data, k) for k in DATA_FILES}
    for stage, ident in predicted_identities(cfg, store).items():
        key = key_of(ident)
        try:
            manifest = store.read_manifest(cfg.run.name, stage)
        except ManifestError as e:
            out[stage] = f"run (the stored manifest is invalid and will be replaced: {e})"
            continue
        attempt = store.read_json(store.stage_path(cfg.run.name, stage, ATTEMPT))
        if manifest is not None and manifest["key"] == key:
            out[stage] = f"skip (complete, key {key[:12]})"
        elif attempt is not None and attempt.get("key") == key and store.complete_checkpoints(cfg.run.name, stage):
            out[stage] = "resume (checkpoints of this key)"
        elif manifest is not None:
            why = explain(stage, manifest, ident, paths) or ["the stored key differs, no recorded part does"]
            out[stage] = f"run (replaces the stored result: {'; '.join(why)})"
        else:
            out[stage] = "run"
    return out


def nothing_to_run(cfg: PipelineConfig, store) -> list[dict] | None:
    """Each planned stage's summary (stage, key, metrics) when every one is complete under the key it will
    have and the run's report is stored, else None. `rlhf run` then ends here, without a Prefect flow run:
    a skipped stage writes nothing, so the flow would only log skips (and start a temporary API, most of a
    fully skipped rerun's 20 s). A deployment run (`rlhf/full`) still goes through the flow."""
    from rlhf.core.store import StorageError

    try:
        keys = predicted_keys(cfg, store)
        manifests = {stage: store.read_manifest(cfg.run.name, stage) for stage in keys}
        report = store.fs.exists(store.path(cfg.run.name, "_report", "report.md"))
    except (ManifestError, StorageError, ValueError):  # the flow's stage runs name the problem
        return None
    if not keys or not report or any(m is None or m["key"] != keys[s] for s, m in manifests.items()):
        return None
    return [{"stage": s, "key": m["key"], "metrics": m.get("metrics") or {}} for s, m in manifests.items()]


def risky_settings(cfg: PipelineConfig) -> list[str]:
    warnings = []
    for stage in plan(cfg):
        st = cfg.stage(stage)
        lr = getattr(st, "learning_rate", None)
        lora = getattr(getattr(st, "lora", None), "enabled", False)
        usual = SPECS[stage].usual_lr  # outside it: usually a typo or another method's recipe (~10x beyond the papers)
        if lr is not None and usual is not None:
            low, high = usual
            high *= 10 if lora else 1
            if not low <= lr <= high:
                warnings.append(f"{stage}.learning_rate: {lr:g} is outside the usual {low:g} .. {high:g} for {stage}")
    for name in of_kind("rl"):
        st = cfg.stage(name)
        if not st.enabled:
            continue
        beta = st.kl.beta if name == "ppo" else st.beta
        if st.uses_reward_model() and beta == 0:
            warnings.append(f"{name}: KL beta 0 with a learned reward model: nothing holds the policy near the "
                            "reference, so it can exploit the reward model (reward hacking)")
        if cfg.rollout.temperature == 0:
            warnings.append(f"{name}: rollout.temperature 0 samples one greedy answer per prompt: no exploration, "
                            "and every GRPO group has zero advantage")
    if cfg.grpo.enabled and cfg.grpo.group_size < 4:
        warnings.append(f"grpo.group_size: {cfg.grpo.group_size} samples per prompt give a noisy group baseline; "
                        "DeepSeekMath uses 64, TRL defaults to 8")
    for field, dtype in (("dtype", cfg.model.dtype), ("inference_dtype", cfg.model.inference_dtype)):
        # a warning, not a refusal: the stages may run on a GPU work pool, not on the machine that checks
        if dtype in (None, "auto", "float32"):  # auto takes bfloat16 only where it is native
            continue
        try:
            import torch

            if not torch.cuda.is_available() and not (dtype == "bfloat16" and cpu_has_bf16()):
                warnings.append(f"model.{field}: {dtype} on this machine (no GPU; the CPU reports no "
                                f"{'AVX512_BF16 or AMX' if dtype == 'bfloat16' else 'AVX512_FP16'}) is "
                                "emulated and slow; use float32 here")
        except ImportError:
            pass
    return warnings


def report(cfg: PipelineConfig, store) -> list[str]:
    """The preflight as printable lines (validate prints them; the flow logs them before the first stage)."""
    from rlhf.pipeline.memory import stage_estimates
    from rlhf.core.store import StorageError

    lines = []
    try:
        for stage, what in outlook(cfg, store).items():
            lines.append(f"{stage}: {what}")
    except StorageError as e:
        lines.append(f"stage outlook unknown: {e}")
    estimates = stage_estimates(cfg)
    if estimates is None:
        lines.append(f"memory: unknown (no config.json at hand for model {cfg.model.name!r})")
    else:
        for stage, gib in estimates.items():
            parts = ", ".join(f"{k} {v}" for k, v in gib.items() if k != "total")
            lines.append(f"memory {stage}: ~{gib['total']} GiB ({parts})")
    lines += [f"WARNING {w}" for w in risky_settings(cfg)]
    return lines


def check_data(cfg: PipelineConfig) -> list[str]:
    """Validates every local user data file an enabled stage will read (the registry's data_files), row by
    row, and every reward function it calls, before any model is loaded: a bad row raises DataError naming
    the file, line and column (data.on_bad_row: fail), or is counted (drop). Returns one summary line per
    file, where the prompts come from, and the reward terms of the RL stages. Hub dataset names are checked
    by their stage."""
    from rlhf.data.userdata import DataError, load_rows

    files = {key: kind for stage in plan(cfg) for key, kind in SPECS[stage].data_files(cfg).items()}
    lines = []
    for key, kind in files.items():
        source = getattr(cfg.data, key)
        if kind == "prompts" or not source.endswith((".jsonl", ".json", ".parquet")):
            continue
        rows, dropped = load_rows(source, kind, cfg.data.on_bad_row)
        if kind == "prefs" and "prompt" not in rows[0] and "reward_model" in plan(cfg) and cfg.reward_model.kind == "implicit":
            raise DataError(f"{source}: reward_model.kind: implicit scores an answer by its likelihood after the prompt, "
                            "and these pairs have none ({chosen, rejected}, the prompt inside each answer): give each "
                            "row a 'prompt', or use reward_model.kind: classifier")
        lines.append(f"data.{key}: {len(rows)} usable rows" + (f", {len(dropped)} dropped" if dropped else ""))
    from rlhf.data.sources import make_task

    task = make_task(cfg.data)  # one for every check below: a generated task is generated once (lazily)
    if "prompts" in files.values() or any(SPECS[s].kind == "rl" for s in plan(cfg)) or "eval" in plan(cfg):
        lines.append(prompts_line(cfg, task))
    elif not cfg.data.prompts_path and plan(cfg):
        # generated here: task_params that reasoning-gym refuses, and a problem space too small for the sizes,
        # are named before any stage
        task.eval
    return lines + reward_lines(cfg, task)


def prompts_line(cfg: PipelineConfig, task: PromptSource) -> str:
    """Where the prompts come from, read (and checked row by row) the way the stages will read them."""
    n = f"{len(task.train)} training and {len(task.eval)} held-out prompts"
    if not cfg.data.prompts_path:
        rl = f", {len(task.rl)} RL prompts drawn apart from both" if cfg.data.rl_size else ""
        return f"prompts: {cfg.data.task} (generated, data.seed {cfg.data.seed}): {n}{rl}, checked by reasoning-gym's verifier"
    split = cfg.data.eval_prompts_path or f"a split of data.eval_fraction {cfg.data.eval_fraction} by data.seed"
    how = ("open-ended (no answers): judged by the reward model" if task.open_ended else
           f"answers in {cfg.data.answer_column!r}, checked by {cfg.data.verifier}")
    dropped = f", {task.dropped} rows dropped" if task.dropped else ""
    return f"prompts: {cfg.data.prompts_path}: {n} (held out: {split}){dropped}; {how}"


def reward_lines(cfg: PipelineConfig, task: PromptSource) -> list[str]:
    """The reward terms of each enabled RL stage, each checked: a user function imports and, called on two
    real prompts, returns one finite number per completion; a math_verify column is in every prompt row."""
    from rlhf.data.userdata import DataError

    lines = []
    for name in [s for s in plan(cfg) if SPECS[s].kind == "rl"]:
        specs = cfg.stage(name).reward_specs()
        terms = []
        for spec in specs:
            probe = task.train[:2]
            if spec.kind == "math_verify" and (missing := [p.id for p in task.train + task.eval
                                                            if p.columns().get(spec.column) is None]):
                raise DataError(f"{name}.rewards: math_verify reads column {spec.column!r}, which prompt {missing[0]} "
                                f"lacks (its columns: {', '.join(sorted(task.train[0].columns())) or 'none'})")
            if spec.kind == "function":
                # here, not at the top: the module brings torch, transformers and TRL (7-12 s), which a
                # rerun with nothing to do never needs otherwise
                from rlhf.train.rewards import function_scores, import_reward_function

                try:
                    fn = import_reward_function(spec.function)
                    function_scores(fn, probe, [p.answer or "" for p in probe], [[] for _ in probe], spec.function)
                except ValueError as e:
                    raise DataError(f"{name}: {e}") from None
                except Exception as e:  # the user's code failing on real prompts: name it, not a traceback
                    raise DataError(f"{name}: reward function {spec.function}: a probe call on the first "
                                    f"{len(probe)} prompts raised {type(e).__name__}: {str(e)[:300]}") from None
            what = {"math_verify": f"math_verify({spec.column})", "function": f"function({spec.function})"}.get(spec.kind, spec.kind)
            terms.append(f"{spec.weight:g} x {what}")
        if (env := getattr(cfg.stage(name), "environment", None)) is not None:
            from rlhf.envs.base import check

            try:
                cls = check(env.name, env.options, task.rl[:2])
            except ValueError as e:
                raise DataError(f"{name}.environment: {e}") from None
            terms.append("the environment's rewards")
            lines.append(f"{name} environment: {cls}{_options(env.options)}, episodes of up to {env.max_turns} turns and "
                         f"{env.max_tokens} tokens, in a child process ({env.timeout_s:g} s a call, {env.memory_mb} MB)")
        lines.append(f"{name} reward: " + " + ".join(terms))
    if cfg.eval.enabled and (env := cfg.eval.environment) is not None:
        from rlhf.envs.base import check

        try:
            cls = check(env.name, env.options, task.eval[:2])
        except ValueError as e:
            raise DataError(f"eval.environment: {e}") from None
        lines.append(f"eval: episodes with {cls}{_options(env.options)}, up to {env.max_turns} turns and {env.max_tokens} tokens")
    return lines


def _options(options: dict) -> str:
    return f" with {', '.join(f'{k}={v!r}' for k, v in options.items())}" if options else ""
