"""A stage's code version: a hash of exactly the project files its code can run.

The files are found by following imports from the stage's module (and the runner, which executes every
stage), anywhere in a file, imports inside functions included, through rlhf/ and stages/ only. So
editing stages/rollout.py changes the keys of the RL stages that import it, and editing report.py or the
CLI changes no key. Files started by path rather than imported are declared in RUN_BY_PATH.
"""

from __future__ import annotations

import ast
import hashlib
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: rlhf/core/codehash.py
PROJECT = ("rlhf", "stages")
# files a module starts as a program (python path/to/file.py) instead of importing it
RUN_BY_PATH = {"rlhf/engines/vllm_engine.py": ("rlhf/engines/vllm_worker.py",)}


@lru_cache(maxsize=None)
def _project_imports(source: str) -> tuple[str, ...]:
    """Dotted names of project modules (or their members) that `source` imports, at any depth of its syntax
    tree. Cached by the text: every stage's graph passes through the runner's imports, and parsing is what
    costs (the file reads and existence checks do not)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]  # `from rlhf import x`: x may be a module
        else:
            continue
        found += [n for n in names if n.split(".")[0] in PROJECT]
    return tuple(found)


def imported_files(source: str, root: Path) -> set[str]:
    """Project files (relative paths) that `source` imports, at any depth of its syntax tree."""
    found = set()
    for name in _project_imports(source):
        base = name.replace(".", "/")
        found |= {rel for rel in (f"{base}.py", f"{base}/__init__.py") if (root / rel).is_file()}
    return found


@lru_cache(maxsize=None)
def code_files(module_file: str, root: Path = ROOT) -> tuple[str, ...]:
    """module_file and every project file reachable from it through imports, sorted."""
    seen, todo = set(), [module_file, "rlhf/pipeline/runner.py"]
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        todo += imported_files((root / rel).read_text(), root) - seen
        todo += [f for f in RUN_BY_PATH.get(rel, ()) if f not in seen]
    return tuple(sorted(seen))


def code_version(module_file: str, root: Path = ROOT) -> str:
    h = hashlib.sha256()
    for rel in code_files(module_file, root):
        h.update(rel.encode())
        h.update((root / rel).read_bytes())
    return h.hexdigest()[:16]
