"""The package layers and the direction of imports (docs/architecture.md, "Layout"), as import-linter
contracts in pyproject.toml: layers (a module imports its own layer and those below it; every package of
rlhf sits in one), stages independent of each other, Prefect only in the flows and the CLI, and no import
cycle. Imports inside functions count (a lazy import is still a dependency); `if TYPE_CHECKING:` ones do
not (annotations only, never executed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO

LINT = str(Path(sys.executable).parent / "lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the packages under `root` (they come first on the path)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([LINT, "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold():
    done = lint(REPO)
    assert done.returncode == 0 and "Contracts: 5 kept, 0 broken." in done.stdout, done.stdout[-3000:] + done.stderr


def test_the_contracts_see_a_violation(tmp_path):
    for top in ("rlhf", "stages", "flows"):
        shutil.copytree(REPO / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    # inside a function: found; under TYPE_CHECKING: skipped
    (tmp_path / "rlhf" / "maths" / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlhf.cli import main\n"
        "def f():\n    from rlhf.pipeline import runner\n")
    with open(tmp_path / "stages" / "sft.py", "a") as f:
        f.write("\n\ndef _peek():\n    import stages.dpo\n")
    (tmp_path / "rlhf" / "core" / "y.py").write_text("import prefect\n")
    (tmp_path / "rlhf" / "extras").mkdir()
    (tmp_path / "rlhf" / "extras" / "__init__.py").write_text("")
    done = lint(tmp_path)
    assert done.returncode == 1, done.stdout[-3000:]
    out = done.stdout
    assert "a module imports its own layer and the layers below it BROKEN" in out
    assert "rlhf.maths.x -> rlhf.pipeline.runner" in out and "rlhf.maths.x -> rlhf.cli.main" not in out
    assert "every package of rlhf sits in a layer BROKEN" in out and "rlhf.extras" in out
    assert "a stage never imports another (the runner launches them by name) BROKEN" in out and "stages.sft -> stages.dpo" in out
    assert "Prefect only in the flows and the CLI BROKEN" in out and "rlhf.core.y -> prefect" in out


def test_no_flow_file_is_named_like_a_package_of_ours():
    # Prefect loads a deployment's entrypoint as a module named after its file: flows/rlhf.py would become
    # `rlhf` in the flow-run process and hide every rlhf.* module not imported yet
    assert {p.stem for p in (REPO / "flows").glob("*.py")} & {"rlhf", "stages", "flows"} == set()
