"""What a run will do before it starts: per stage skip / resume / run for this run name (from the predicted
content keys and what is in the store), the memory estimate, and warnings about risky settings.
`rlhf validate` prints it; every run logs it first.
"""

from __future__ import annotations

from rlhf.core import cluster, tracking
from rlhf.core.config import PipelineConfig
from rlhf.core.registry import SPECS, of_kind, plan, stage_inputs
from rlhf.pipeline.identity import DATA_FILES, explain, identity, key_of
from rlhf.core.manifest import ManifestError
from rlhf.core.store import ATTEMPT, endpoint_problem


def network_problems(cfg: PipelineConfig, timeout: float = 3.0) -> list[str]:
    """Every server the run will reach, asked once each with a timeout, before any work: the S3 endpoint,
    the tracking servers and the Ray clusters. One 'key: problem' line each, naming the address."""
    return ([p for p in [endpoint_problem(cfg.storage, timeout)] if p] + tracking.network_problems(cfg.tracking, timeout)
            + cluster.network_problems(cfg, timeout))


def predicted_identities(cfg: PipelineConfig) -> dict[str, dict]:
    """Identities the stages will have (rlhf/pipeline/identity.py): each depends only on config, code, data,
    model, packages and its inputs' keys, so the whole plan is known before any stage runs."""
    idents: dict[str, dict] = {}
    for stage in plan(cfg):
        idents[stage] = identity(cfg, stage, {s: key_of(idents[s]) for s in stage_inputs(cfg, stage)})
    return idents


def predicted_keys(cfg: PipelineConfig) -> dict[str, str]:
    return {stage: key_of(ident) for stage, ident in predicted_identities(cfg).items()}


def outlook(cfg: PipelineConfig, store) -> dict[str, str]:
    """stage -> 'skip (complete, key ...)', 'resume (checkpoints of this key)' or 'run', with what changed
    since the stored result when there is one (a data file, the model's weights, a package, a code file,
    a config value, an upstream stage)."""
    out = {}
    paths = {k: getattr(cfg.data, k) for k in DATA_FILES}
    for stage, ident in predicted_identities(cfg).items():
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
        if st.reward_source in ("reward_model", "sum") and beta == 0:
            warnings.append(f"{name}: KL beta 0 with a learned reward model: nothing holds the policy near the "
                            "reference, so it can exploit the reward model (reward hacking)")
        if cfg.rollout.temperature == 0:
            warnings.append(f"{name}: rollout.temperature 0 samples one greedy answer per prompt: no exploration, "
                            "and every GRPO group has zero advantage")
    if cfg.grpo.enabled and cfg.grpo.group_size < 4:
        warnings.append(f"grpo.group_size: {cfg.grpo.group_size} samples per prompt give a noisy group baseline; "
                        "DeepSeekMath uses 64, TRL defaults to 8")
    if cfg.model.dtype != "float32":
        try:
            import torch

            if not torch.cuda.is_available():
                warnings.append(f"model.dtype: {cfg.model.dtype} on a machine without a GPU is slow or unsupported; "
                                "use float32 here")
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
    row, before any model is loaded: a bad row raises DataError naming the file, line and column
    (data.on_bad_row: fail), or is counted (drop). Returns one summary line per file. Hub dataset names are
    checked by their stage."""
    from rlhf.data.userdata import load_rows

    files = {key: kind for stage in plan(cfg) for key, kind in SPECS[stage].data_files(cfg).items()}
    lines = []
    for key, kind in files.items():
        source = getattr(cfg.data, key)
        if not source.endswith((".jsonl", ".json", ".parquet")):
            continue
        rows, dropped = load_rows(source, kind, cfg.data.on_bad_row)
        lines.append(f"data.{key}: {len(rows)} usable rows" + (f", {len(dropped)} dropped" if dropped else ""))
    return lines
