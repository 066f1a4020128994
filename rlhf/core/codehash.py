"""A stage's code version: a hash of exactly the project files its code can run.

The files are found by following imports from the stage's module (and the runner, which executes every
stage), anywhere in a file, imports inside functions included, through rlhf/ and stages/ only. So
editing stages/rollout.py changes the keys of the RL stages that import it, and editing report.py or the
CLI changes no key. Files started by path rather than imported are declared in RUN_BY_PATH. The same walk
serves the reference caches' keys, a user's reward-function package (rlhf/core/fingerprint.py), and the
third-party packages a stage's code imports (whose versions are keyed too).
"""

from __future__ import annotations

import ast
import hashlib
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: rlhf/core/codehash.py
PROJECT = ("rlhf", "stages")
RUNNER = "rlhf/pipeline/runner.py"  # executes every stage: part of every stage's code
# files a module starts as a program (python path/to/file.py) instead of importing it
RUN_BY_PATH = {"rlhf/engines/vllm_engine.py": ("rlhf/engines/vllm_worker.py",)}


@lru_cache(maxsize=None)
def _imports(source: str) -> tuple[str, ...]:
    """Dotted names of the modules (or their members) that `source` imports, at any depth of its syntax
    tree. Cached by the text: every stage's graph passes through the runner's imports, and parsing is what
    costs (the file reads and existence checks do not)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]  # `from rlhf import x`: x may be a module
    return tuple(found)


def imported_files(source: str, root: Path, packages: tuple[str, ...] = PROJECT) -> set[str]:
    """Files under `root` (relative paths) of `packages` that `source` imports, at any depth of its syntax tree."""
    found = set()
    for name in _imports(source):
        if name.split(".")[0] in packages:
            base = name.replace(".", "/")
            found |= {rel for rel in (f"{base}.py", f"{base}/__init__.py") if (root / rel).is_file()}
    return found


@lru_cache(maxsize=None)
def closure(start: str | tuple[str, ...], root: Path = ROOT, packages: tuple[str, ...] = PROJECT) -> tuple[str, ...]:
    """`start` (one relative path or several) and every file of `packages` under `root` reachable from it
    through imports, sorted."""
    seen, todo = set(), [start] if isinstance(start, str) else list(start)
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        todo += imported_files((root / rel).read_text(), root, packages) - seen
        todo += [f for f in RUN_BY_PATH.get(rel, ()) if f not in seen]
    return tuple(sorted(seen))


def code_files(module_file: str, root: Path = ROOT) -> tuple[str, ...]:
    """module_file, the runner, and every project file reachable from them through imports, sorted."""
    return closure((module_file, RUNNER), root)


def third_party(files: tuple[str, ...], root: Path = ROOT) -> set[str]:
    """Top-level names of the modules outside the project that `files` import (stdlib ones included)."""
    return {name.split(".")[0] for rel in files for name in _imports((root / rel).read_text())} - set(PROJECT)


def digests(files: tuple[str, ...], root: Path = ROOT) -> dict[str, str]:
    """{relative path: first 16 hex digits of the SHA-256 of its bytes}: which file changed is visible."""
    return {rel: hashlib.sha256((root / rel).read_bytes()).hexdigest()[:16] for rel in files}


def version_of(files: dict[str, str]) -> str:
    """One short hash of a {path: digest} mapping (what manifests show as code_version)."""
    return hashlib.sha256(repr(sorted(files.items())).encode()).hexdigest()[:16]


def code_version(module_file: str, root: Path = ROOT) -> str:
    return version_of(digests(code_files(module_file, root), root))
