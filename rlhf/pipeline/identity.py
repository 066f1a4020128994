"""A stage's identity: everything its outputs are a function of, as one JSON-able dict. Its content key
is the hash of that dict, the manifest stores it, and `rlhf validate` and `rlhf diff` explain a changed
key by the parts of it that changed.

Parts: the stage's config section and the other sections it reads (`shared`), `run.seed`, its inputs'
keys, the base model (name, dtype, and its weights' fingerprint), the data section with every data file
the stage reads replaced by its content's digest (files it does not read are left out; paths are not
content), the user functions it calls (their source), the versions of the numeric packages its code
imports, and its code (a digest per project file). Where a stage runs (work pool, job variables, launch
placement) is not part of it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rlhf.core import codehash, fingerprint
from rlhf.core.config import PipelineConfig
from rlhf.core.models import inference_model, model_identity
from rlhf.core.registry import SPECS

# where a stage runs: not part of its key
PLACEMENT = {"work_pool": True, "job_variables": True, "enabled": True,
             "launch": {"backend": True, "ray": True, "nnodes": True, "rendezvous": True}}
DATA_FILES = ("sft_path", "prefs_path", "unpaired_path", "prompts_path", "eval_prompts_path")  # a file or a hub dataset


def module_file(stage: str) -> str:
    return SPECS[stage].module.replace(".", "/") + ".py"


def shared_sections(cfg: PipelineConfig, stage: str) -> dict[str, dict]:
    """The other config sections in a stage's key, as the key hashes them and its manifest records them."""
    return {sec: cfg.stage(sec).model_dump(mode="json", exclude=PLACEMENT) for sec in SPECS[stage].shared}


def data_part(cfg: PipelineConfig, stage: str) -> dict[str, Any]:
    """The data section as `stage` reads it: generator settings as they are, each data file it reads as its
    content's fingerprint, the files it does not read left out."""
    reads = SPECS[stage].data_files(cfg)
    out = {k: v for k, v in cfg.data.model_dump(mode="json").items() if k not in DATA_FILES}
    for key in DATA_FILES:
        value = getattr(cfg.data, key)
        if value and key in reads:
            out[key] = fingerprint.data_source(value)
    return out


def packages_part(cfg: PipelineConfig, stage: str, files: tuple[str, ...]) -> dict[str, str]:
    """Versions of the numeric packages the stage's code imports (and what they require); vLLM's from its own
    environment when the rollout engine is vLLM and the stage's code can start it."""
    extra = {}
    if cfg.rollout.engine == "vllm" and "rlhf/engines/vllm_engine.py" in files:  # "missing": the stage says where
        extra["vllm"] = fingerprint.installed_version(fingerprint.vllm_python_path(cfg.rollout.vllm.python), "vllm") or "missing"
    return fingerprint.packages(codehash.third_party(files), extra)


def model_part(cfg: PipelineConfig, stage: str) -> dict[str, Any]:
    """The base model as `stage` sees it: inference-only stages record `model.inference_dtype` where it
    changes their dtype; the others never read it, so setting it does not change their keys."""
    part = {**model_identity(cfg.model), **fingerprint.model(cfg.model.name)}
    used = inference_model(cfg.model).dtype
    if SPECS[stage].kind == "inference" and used != cfg.model.dtype:
        part["inference_dtype"] = used
    return part


def identity(cfg: PipelineConfig, stage: str, input_keys: dict[str, str]) -> dict[str, Any]:
    files = codehash.code_files(module_file(stage))
    return {
        "stage": stage,
        "config": cfg.stage(stage).model_dump(mode="json", exclude=PLACEMENT),
        # sections of other stages that this one reads (the RL loop samples with the rollout settings)
        "shared": shared_sections(cfg, stage),
        "model": model_part(cfg, stage),
        "data": data_part(cfg, stage),
        "seed": cfg.run.seed,
        "inputs": input_keys,
        "functions": {f: fingerprint.function(f) for f in SPECS[stage].functions(cfg)},
        "models": {m: fingerprint.model(m) for m in SPECS[stage].models(cfg)},
        "packages": packages_part(cfg, stage, files),
        "code": codehash.digests(files),
    }


def key_of(ident: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def flatten(value: Any, prefix: str) -> dict[str, Any]:
    """{'a': {'b': 1}, 'c': [1]} under 'x' -> {'x.a.b': 1, 'x.c': [1]} (lists stay values)."""
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for k, v in value.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def shown(value: Any) -> str:
    """A value from a manifest (a shared store) cut to one short line."""
    text = repr(value).replace("\n", "\\n")
    return text if len(text) <= 60 else text[:57] + "..."


def _placed(config: Any, spec: dict = PLACEMENT) -> Any:
    """A stage's config without its placement keys (a manifest records them; the key does not hash them)."""
    if not isinstance(config, dict):
        return config
    return {k: v if k not in spec else _placed(v, spec[k]) for k, v in config.items() if spec.get(k) is not True}


def _changed(a: dict, b: dict) -> list[tuple[str, Any, Any]]:
    missing = "(unset)"
    return [(k, a.get(k, missing), b.get(k, missing)) for k in sorted({*a, *b}) if a.get(k, missing) != b.get(k, missing)]


def _code_version(ident: dict) -> str | None:
    code = ident.get("code")
    return ident.get("code_version") or (codehash.version_of(code) if isinstance(code, dict) else None)


def explain(stage: str, old: dict, new: dict, paths: dict[str, str] | None = None) -> list[str]:
    """Why two identities (a stored manifest's and a predicted one, or two runs' manifests) differ, one
    line per changed part, e.g. `data file data.sft_path (/x/sft.jsonl): content changed`, `package trl:
    '1.16.0' -> '1.17.0'`, `code: rlhf/train/training.py changed`. `paths`: the current data paths, to name
    the files. Fields a manifest of an older version lacks read as unset."""
    out = []
    for path, a, b in _changed(flatten(_placed(old.get("config", {})), stage), flatten(_placed(new.get("config", {})), stage)):
        out.append(f"{path}: {shown(a)} -> {shown(b)}")
    for path, a, b in _changed(flatten(old.get("shared", {}), ""), flatten(new.get("shared", {}), "")):
        out.append(f"{path}: {shown(a)} -> {shown(b)}")
    if old.get("seed") != new.get("seed"):
        out.append(f"run.seed: {shown(old.get('seed'))} -> {shown(new.get('seed'))}")
    old_model, new_model = old.get("model") or {}, new.get("model") or {}
    for k, a, b in _changed(old_model, new_model):
        if k == "files" and "files" in old_model and "files" in new_model:
            out.append(f"model weights ({new_model.get('name')}): content changed")
        else:
            out.append(f"model.{k}: {shown(a)} -> {shown(b)}")
    old_data, new_data = old.get("data") or {}, new.get("data") or {}
    for k in sorted({*old_data, *new_data}):
        a, b = old_data.get(k, "(unset)"), new_data.get(k, "(unset)")
        if a == b:
            continue
        if k in DATA_FILES and isinstance(a, dict) and isinstance(b, dict):
            where = f" ({(paths or {}).get(k)})" if (paths or {}).get(k) else ""
            out.append(f"data file data.{k}{where}: content changed")
        elif k in DATA_FILES:
            out.append(f"data file data.{k}: {'now read' if isinstance(b, dict) else 'no longer read'}")
        else:
            out.append(f"data.{k}: {shown(a)} -> {shown(b)}")
    for f, a, b in _changed(old.get("functions") or {}, new.get("functions") or {}):
        files = sorted(k for k, _, _ in _changed(a if isinstance(a, dict) else {}, b if isinstance(b, dict) else {}))
        out.append(f"your code {f}: " + (f"source changed ({', '.join(files)})" if files else "added or removed"))
    for m, a, b in _changed(old.get("models") or {}, new.get("models") or {}):
        out.append(f"model {m}: " + ("added" if a == "(unset)" else "removed" if b == "(unset)" else "weights changed"))
    for dist, a, b in _changed(old.get("packages") or {}, new.get("packages") or {}):
        out.append(f"package {dist}: {shown(a)} -> {shown(b)}")
    if isinstance(old.get("code"), dict) and isinstance(new.get("code"), dict):
        for rel, a, b in _changed(old["code"], new["code"]):
            out.append(f"code: {rel} " + ("added" if a == "(unset)" else "removed" if b == "(unset)" else "changed"))
    elif _code_version(old) != _code_version(new):  # a manifest written before per-file digests
        out.append(f"code version: {shown(_code_version(old))} -> {shown(_code_version(new))}")
    for up, a, b in _changed(old.get("inputs") or {}, new.get("inputs") or {}):
        out.append(f"upstream {up}: its key changed")
    return out
