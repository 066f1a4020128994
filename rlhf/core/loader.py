"""Load pipeline.yaml: merge a profile, apply `--set` overrides, validate, explain errors by key path."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rlhf.core.config import ConfigError, PipelineConfig, StorageConfig  # noqa: F401 (ConfigError: importers know it from here)
from rlhf.core import cluster, tracking
from rlhf.core.registry import of_kind

_PREFIXED = re.compile(r"^([A-Za-z_][\w.]*): (.*)$", re.S)


# Bounds on what a config may expand to: a few KB of nested YAML aliases can otherwise stand for
# billions of nodes (the "billion laughs" document) once copied or validated.
MAX_YAML_BYTES = 1_000_000
MAX_YAML_NODES = 100_000  # after alias expansion; pipeline.yaml is about 400
MAX_YAML_DEPTH = 32


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader that also refuses duplicate keys (the last one would silently win)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


_BoundedLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _BoundedLoader.construct_mapping)


def _is_text(value: str) -> bool:
    """Encodable as UTF-8: YAML's \\uD800 escapes and undecodable command-line bytes give lone surrogates,
    which no file name, log line or Parquet string can hold."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _expanded_size(node, memo: dict, depth: int = 0) -> int:
    """Nodes in the document with every alias expanded, computed once per distinct node."""
    if depth > MAX_YAML_DEPTH:
        raise yaml.YAMLError(f"nested deeper than {MAX_YAML_DEPTH} levels")
    if isinstance(node, yaml.ScalarNode) and not _is_text(node.value):
        raise yaml.YAMLError(f"line {node.start_mark.line + 1}: a value is not valid Unicode text (a lone surrogate "
                             "such as \\ud800)")
    if id(node) not in memo:
        children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else (
            node.value if isinstance(node, yaml.SequenceNode) else [])
        memo[id(node)] = 1 + sum(_expanded_size(c, memo, depth + 1) for c in children)
    return memo[id(node)]


def load_yaml(text: str) -> Any:
    """safe_load with bounds on size, alias expansion and depth, and no duplicate keys; YAMLError otherwise."""
    if len(text) > MAX_YAML_BYTES:
        raise yaml.YAMLError(f"document is {len(text)} characters; at most {MAX_YAML_BYTES}")
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, {})
        if size > MAX_YAML_NODES:
            raise yaml.YAMLError(f"expands to {size} nodes through aliases; at most {MAX_YAML_NODES}")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def apply_override(raw: dict, assignment: str) -> dict:
    """`a.b.c=value`; the value is parsed as YAML, so `3`, `true`, `[a, b]` and `null` get their types."""
    if not _is_text(assignment):
        raise ConfigError("--set", [f"{ascii(assignment)[:80]}: not valid Unicode text"])
    if "=" not in assignment:
        raise ConfigError("--set", [f"{assignment!r}: expected key.path=value"])
    path, _, text = assignment.partition("=")
    keys = path.strip().split(".")
    if not all(keys):
        raise ConfigError("--set", [f"{assignment!r}: empty key in path {path!r}"])
    try:
        value = load_yaml(text) if text.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError("--set", [f"{path}: value {text[:80]!r} is not valid YAML ({getattr(e, 'problem', None) or e})"]) from None
    out = copy.deepcopy(raw)
    node = out
    for i, k in enumerate(keys[:-1]):
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError("--set", [f"{'.'.join(keys[: i + 1])}: is a value, not a section"])
        node = nxt
    node[keys[-1]] = value
    return out


class _Shown:
    """A rejected value as the error line shows it: its repr, cut to one readable line."""

    def __init__(self, value):
        self.text = repr(value).replace("\n", "\\n")
        if len(self.text) > 80:
            self.text = self.text[:77] + "..."

    def __repr__(self) -> str:
        return self.text


def _key(part) -> str:
    """A key path segment as shown: odd keys from the user's file quoted, so the path stays readable."""
    text = str(part)
    return text if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+", text) else repr(_Shown(text))


def _describe(err: dict) -> str:
    loc = ".".join(_key(p) for p in err["loc"])
    kind, ctx, got = err["type"], err.get("ctx", {}), _Shown(err.get("input"))
    if kind == "extra_forbidden":
        return f"{loc}: unknown key"
    if kind == "missing":
        return f"{loc}: required key is missing"
    if kind == "literal_error":
        return f"{loc}: must be one of {ctx.get('expected')}, got {got!r}"
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"{loc}: must be {bounds[kind]} {limit}, got {got!r}"
    if kind == "value_error":
        msg = str(ctx.get("error", err["msg"]))
        m = _PREFIXED.match(msg)
        if m and "." in m.group(1):  # an absolute path from the top-level validator
            return msg
        if m:
            return f"{loc + '.' if loc else ''}{m.group(1)}: {m.group(2)}"
        return f"{loc}: {msg}"
    msg = err["msg"]  # pydantic's sentence, lower-cased at its start only: a pattern in it keeps its case
    return f"{loc}: {msg[:1].lower()}{msg[1:]}, got {got!r}"


def _allowed_keys(model: type, loc: tuple) -> list[str]:
    """Walk the model tree along `loc` to list the keys that section accepts."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not hasattr(field.annotation, "model_fields"):
            return []
        model = field.annotation
    return sorted(model.model_fields)


def validate(raw: dict, source: str) -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            line = _describe(err)
            if err["type"] == "extra_forbidden":
                allowed = _allowed_keys(PipelineConfig, tuple(err["loc"]))
                line += f"; allowed: {', '.join(allowed)}" if allowed else ""
            problems.append(line)
        raise ConfigError(source, problems) from None


def _resolve_local(url: str | None, base: Path) -> str | None:
    if url is None or not url.strip() or "://" in url and not url.startswith("file://"):
        return url
    path = Path(url.removeprefix("file://")).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def load_config(path: str | Path, profile: str = "default", overrides: list[str] | tuple = ()) -> PipelineConfig:
    """Read `path`, merge `profiles.<profile>` over the base, apply overrides, validate.

    Relative local paths (storage.url, data.*_path) resolve against the config file's folder, so a
    worker started elsewhere reads the same artifacts. Makes no network call: the servers a run reaches
    (S3, tracking, Ray) are probed by rlhf.pipeline.preflight.network_problems.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), ["file not found"])
    try:
        raw = load_yaml(path.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(str(path), [f"not valid YAML: {e}"]) from None
    if not isinstance(raw, dict):
        raise ConfigError(str(path), ["top level must be a mapping of sections"])
    profiles = raw.pop("profiles", None) or {}
    if not isinstance(profiles, dict):
        raise ConfigError(str(path), [f"profiles: must be a mapping of profile names to overrides, got {_Shown(profiles)!r}"])
    if profile != "default":
        if profile not in profiles:
            avail = ", ".join(["default", *profiles])
            raise ConfigError(str(path), [f"profile: unknown profile {profile!r}; available: {avail}"])
        if not isinstance(profiles[profile], dict):
            raise ConfigError(str(path), [f"profiles.{profile}: must be a mapping of overrides, got {_Shown(profiles[profile])!r}"])
        raw = deep_merge(raw, profiles[profile])
    raw["profile"] = profile
    for assignment in overrides:
        raw = apply_override(raw, assignment)
    base = path.resolve().parent
    if raw.get("storage") is None:  # the default store is a folder beside the config too
        raw["storage"] = {}
    if isinstance(raw["storage"], dict):
        raw["storage"].setdefault("url", StorageConfig.model_fields["url"].default)
    for section, key in (("storage", "url"), *(("data", k) for k in DATA_KEYS)):
        sec = raw.get(section)
        if isinstance(sec, dict) and isinstance(sec.get(key), str):
            local = section == "storage" or _is_file_like(sec[key]) or (base / sec[key]).exists()
            sec[key] = _resolve_local(sec[key], base) if local else sec[key]
    evaluated = raw.get("eval", {}).get("policies") if isinstance(raw.get("eval"), dict) else None
    if isinstance(evaluated, list):  # model:<local folder> policies resolve against the config's folder too
        raw["eval"]["policies"] = [f"model:{_resolve_local(p[6:], base)}" if isinstance(p, str) and p.startswith("model:")
                                   and p[6:].startswith((".", "~", "file://")) else p for p in evaluated]
    cfg = validate(raw, str(path))
    problems = local_path_problems(cfg) + tracking.backend_problems(cfg.tracking) + cluster.launch_problems(cfg)
    if problems:
        raise ConfigError(str(path), problems)
    return cfg


DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
PROMPT_KEYS = ("prompts_path", "eval_prompts_path")
DATA_KEYS = ("sft_path", "prefs_path", "unpaired_path", *PROMPT_KEYS)  # data keys naming a file, folder or hub dataset


def local_path_problems(cfg: PipelineConfig) -> list[str]:
    """Local files the run would open, checked at load time: a missing model folder or data file would
    otherwise fail only after the run took its lock (or, for a data path with another suffix, be handed
    to `datasets.load_dataset` as a hub name)."""
    problems = []
    name = cfg.model.name
    if name.startswith(("/", ".", "~")):
        folder = Path(name).expanduser()
        if not folder.is_dir():
            problems.append(f"model.name: local path {name!r} does not exist (or is not a folder)")
        elif not (folder / "config.json").is_file():
            problems.append(f"model.name: {name!r} is not a model folder (no config.json in it)")
    for key in DATA_KEYS:
        value = getattr(cfg.data, key)
        if value is None or not value.startswith("/"):  # hub dataset names stay for their stage to fetch
            continue
        if key in PROMPT_KEYS and Path(value).is_dir():  # a dataset saved with `datasets`' save_to_disk
            if not any((Path(value) / f).is_file() for f in ("dataset_info.json", "dataset_dict.json")):
                problems.append(f"data.{key}: {_Shown(value)!r} is a folder but not a saved Hugging Face dataset "
                                "(no dataset_info.json or dataset_dict.json)")
        elif not value.endswith(DATA_SUFFIXES):
            problems.append(f"data.{key}: {_Shown(value)!r} has an unsupported suffix; use .jsonl, .json or .parquet"
                            + (" (or a saved Hugging Face dataset folder)" if key in PROMPT_KEYS else ""))
        elif not Path(value).is_file():
            problems.append(f"data.{key}: file not found: {_Shown(value)!r}")
    return problems


def _is_file_like(value: str) -> bool:
    """A Hugging Face dataset name ('org/name') stays as is; paths with a data suffix are files."""
    return value.endswith(DATA_SUFFIXES) or value.startswith(("/", ".", "~", "file://"))


def derived_quantities(cfg: PipelineConfig) -> dict[str, dict[str, Any]]:
    """Batch-size semantics, spelled out per enabled stage. A Trainer stage's optimizer step takes
    per_device_batch_size x gradient_accumulation_steps rows on each of launch.processes ranks."""
    out: dict[str, dict[str, Any]] = {}
    n_train = cfg.data.train_size
    for name in of_kind("trainer"):
        st = cfg.stage(name)
        if not st.enabled:
            continue
        per_step = st.per_device_batch_size * st.gradient_accumulation_steps * st.launch.processes
        if name != "sft" and cfg.preferences.enabled:
            # on-policy pairs: one per prompt whose answers are not all judged equal, known after sampling
            prompts = cfg.preference_prompts()
            per_prompt = 1 if cfg.preferences.pairing == "best_worst" else math.comb(cfg.preferences.samples_per_prompt, 2)
            bound = prompts * min(per_prompt, cfg.preferences.max_pairs_per_prompt or per_prompt)
            rows = bound * (2 if name == "kto" else 1)
            if name == "reward_model":  # + at most one contrast pair per base answer
                rows += prompts * cfg.preferences.contrast_samples
            shown = f"from the preferences stage (at most {rows})"
        else:
            rows = {"sft": n_train, "kto": 2 * n_train}.get(name, int(n_train * (1 - getattr(st, "eval_fraction", 0.0))))
            shown = rows if cfg.data.sft_path is None or name != "sft" else "from data.sft_path"
        steps = st.max_steps if st.max_steps > 0 else math.ceil(rows * st.num_epochs / per_step)
        out[name] = {
            "samples_per_optimizer_step": per_step,
            "optimizer_steps": steps if st.max_steps > 0 or shown == rows else f"at most {steps}",
            "train_rows": shown,
            "max_tokens_seen": steps * per_step * st.max_length,
            "checkpoints": steps // st.save_steps,
        }
        if name == "dpo" and st.rounds > 1:  # iterative DPO: each later round samples and pairs again (needs preferences)
            out[name].update({"rounds": st.rounds, "optimizer_steps": f"{out[name]['optimizer_steps']} per round",
                              "samples_per_later_round": cfg.preference_prompts() * cfg.preferences.samples_per_prompt})
    for name in of_kind("rl"):
        st = cfg.stage(name)
        if not st.enabled:
            continue
        rollouts = st.rollouts_per_iteration()
        steps = st.epochs * rollouts // st.minibatch_size
        out[name] = {
            "rollouts_per_iteration": rollouts,
            # skipped uniform groups shrink the trained batch (to a quarter of it in the default run)
            "optimizer_steps_per_iteration": f"at most {steps}" if getattr(st, "skip_uniform_groups", False) else steps,
            "total_rollouts": rollouts * st.iterations,
            "max_tokens_generated": rollouts * st.iterations * cfg.rollout.max_new_tokens,
        }
    for name, launch in cluster.ray_stages(cfg).items():
        out.setdefault(name, {})["ray_bundles"] = cluster.describe(launch)
    return out
