"""What a stage's outputs depend on besides its config: the bytes of the data files it reads, the base
model's weights, the source of user reward functions, the versions of the packages that change numerics,
and the code it runs. Every stage key (rlhf/pipeline/identity.py) and every cache key (the reference
log-prob caches) is built from these, so none of them can say "unchanged" about something that changed.

Files are hashed by content (SHA-256, streamed), never keyed by name: a data file edited in place or a
model folder whose weights were replaced changes the key, and a file that was only touched or moved does
not. Digests are cached per machine by (path, size, mtime, ctime, inode) in `<RLHF_HOME>/fingerprints.json`,
so a 500 MB folder is read once; ctime changes with any write and cannot be set back by tools like
`cp -p` or `touch`, so a replaced file is always hashed again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import re
import uuid
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from rlhf.core.models import EMBEDDED, home

# Packages whose version can change a stage's numbers (kernels, tokenization, trainers, samplers, verifiers).
# A stage keys those its code imports, and those they require in turn (their installed metadata says which).
NUMERIC = ("torch", "transformers", "trl", "peft", "accelerate", "vllm", "bitsandbytes", "reasoning-gym",
           "math-verify")
# The files of a model folder that determine its outputs (a README or a training log does not).
MODEL_FILES = ("*.safetensors", "*.bin", "*.pt", "*.gguf", "config.json", "generation_config.json", "tokenizer*",
               "special_tokens_map.json", "added_tokens.json", "chat_template*", "*.model", "vocab*", "merges.txt",
               "adapter_config.json")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def _cache_path() -> Path:
    return home() / "fingerprints.json"


def _read_cache() -> dict:
    try:
        data = json.loads(_cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def file_digest(path: str | Path) -> str:
    """SHA-256 of a file's bytes, read once per content (cached by size, mtime, ctime and inode)."""
    path = Path(path).resolve()
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    cache = _read_cache()
    hit = cache.get(str(path))
    if isinstance(hit, dict) and hit.get("stamp") == stamp and isinstance(hit.get("sha256"), str):
        return hit["sha256"]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    cache = _read_cache()  # another process may have added entries meanwhile
    cache[str(path)] = {"stamp": stamp, "sha256": digest}
    _cache_path().parent.mkdir(parents=True, exist_ok=True)
    tmp = _cache_path().with_name(f"fingerprints.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(cache))
    tmp.replace(_cache_path())  # whole or absent; a lost concurrent entry is only hashed again
    return digest


def folder_digest(folder: str | Path, patterns: tuple[str, ...]) -> str:
    """One digest over the files of `folder` (top level) matching `patterns`: their names and contents."""
    h = hashlib.sha256()
    for path in sorted({p for pattern in patterns for p in Path(folder).glob(pattern) if p.is_file()}):
        h.update(path.name.encode())
        h.update(file_digest(path).encode())
    return h.hexdigest()


def hub_revision(repo_id: str, repo_type: str = "model") -> str:
    """The commit a hub id resolves to now: asked of the hub (5 s), else the local hub cache's `refs/main`,
    else 'unresolved' (offline and never downloaded: the stage will fail to load it anyway)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") in ("0", "", "false"):
        try:
            from huggingface_hub import HfApi

            info = (HfApi().model_info if repo_type == "model" else HfApi().dataset_info)(repo_id, timeout=5)
            if info.sha:
                return info.sha
        except Exception:  # offline, unknown repo, gated: the cache may still know
            pass
    try:
        from huggingface_hub.constants import HF_HUB_CACHE

        ref = Path(HF_HUB_CACHE) / f"{repo_type}s--{repo_id.replace('/', '--')}" / "refs" / "main"
        return ref.read_text().strip()
    except (ImportError, OSError):
        return "unresolved"


def data_source(value: str) -> dict:
    """A data file by its content ({'sha256'}), or a hub dataset by its revision ({'hub', 'revision'})."""
    if value.endswith(DATA_SUFFIXES) or value.startswith(("/", ".", "~")):
        return {"sha256": file_digest(Path(value).expanduser())}
    return {"hub": value, "revision": hub_revision(value, "dataset")}


def model(name: str) -> dict:
    """The base model's weights: the embedded package's version, the tiny model's settings (keyed with the
    config), a local folder's file contents, or a hub id's commit."""
    if name in (EMBEDDED, "tiny"):
        return {}  # rlhf/core/models.py model_identity records the package version and the tiny settings
    path = Path(name).expanduser()
    if path.is_dir():
        return {"files": folder_digest(path, MODEL_FILES)}
    return {"hub": name, "revision": hub_revision(name)}


def _module_root(module: str) -> tuple[Path, Path] | None:
    """(the module's file, the folder its top-level package sits in), without importing the module itself."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    origin = Path(spec.origin).resolve()
    depth = module.count(".") + (1 if origin.name == "__init__.py" else 0)
    return origin, origin.parents[depth]


def function(spec: str) -> dict[str, str]:
    """A user function 'module:function' by the source of its module and of the modules of the same
    top-level package it imports, at any depth ({relative path: digest}); empty when it cannot be found
    (the stage's own import then fails with a clear message)."""
    from rlhf.core.codehash import closure

    module = spec.partition(":")[0]
    found = _module_root(module)
    if found is None:
        return {}
    origin, root = found
    files = closure(str(origin.relative_to(root)), root, (module.split(".")[0],))
    return {rel: file_digest(root / rel)[:16] for rel in files}


@lru_cache(maxsize=None)
def _distributions() -> dict[str, list[str]]:
    return metadata.packages_distributions()


@lru_cache(maxsize=None)
def _requires(dist: str) -> tuple[str, ...]:
    """Names of the distributions `dist` requires unconditionally (no extras, no environment markers)."""
    try:
        reqs = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return ()
    return tuple(_norm(re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0]) for r in reqs if ";" not in r)


@lru_cache(maxsize=None)
def _required(dists: frozenset[str]) -> frozenset[str]:
    """`dists` and every distribution they require, transitively (installed metadata, read once per process)."""
    todo, seen = set(dists), set()
    while todo:
        dist = todo.pop()
        if dist not in seen:
            seen.add(dist)
            todo |= set(_requires(dist)) - seen
    return frozenset(seen)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def packages(import_names: set[str], extra: dict[str, str] | None = None) -> dict[str, str]:
    """Versions of the NUMERIC packages among the distributions that provide `import_names` (top-level
    module names) and the distributions those require, transitively; the Python version; `extra` on top
    (a version found elsewhere, e.g. vLLM in its own environment)."""
    seen = _required(frozenset(_norm(d) for name in import_names for d in _distributions().get(name, [])))
    out = {"python": platform.python_version()}
    for dist in NUMERIC:
        if dist in seen:
            try:
                out[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                pass
    return {**out, **(extra or {})}


def vllm_python_path(configured: str | None = None) -> Path:
    """Where vLLM's own environment's interpreter is meant to be: rollout.vllm.python, else RLHF_VLLM_PYTHON,
    else .venv-vllm/ in the checkout (./setup-vllm.sh builds it there)."""
    return Path(configured or os.environ.get("RLHF_VLLM_PYTHON") or Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python")


def installed_version(python: str | Path, dist: str) -> str | None:
    """A distribution's version in another environment (its interpreter's path), read from its dist-info
    folder name, without starting that interpreter; None when it is not there."""
    venv = Path(python).parent.parent
    for info in sorted(venv.glob(f"lib/python*/site-packages/{dist.replace('-', '_')}-*.dist-info")):
        return info.name.removesuffix(".dist-info").split("-", 1)[1]
    return None
