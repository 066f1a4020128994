"""Content keys hash exactly the code a stage runs: the files its module (and the runner) import."""

from __future__ import annotations

import shutil

from conftest import REPO
from rlhf.core import codehash
from rlhf.core.registry import SPECS


def versions(root) -> dict[str, str]:
    codehash.closure.cache_clear()
    return {s: codehash.code_version(spec.module.replace(".", "/") + ".py", root) for s, spec in SPECS.items()}


def test_an_edit_changes_the_keys_of_exactly_the_stages_that_import_it(tmp_path):
    for package in ("rlhf", "stages"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    before = versions(tmp_path)
    assert before == versions(REPO)  # same files, same versions: the hash does not depend on the folder

    def edit(rel: str) -> set[str]:
        previous = versions(tmp_path)
        with open(tmp_path / rel, "a") as f:
            f.write("# a comment\n")
        now = versions(tmp_path)
        return {s for s in previous if previous[s] != now[s]}

    assert edit("stages/rollout.py") == {"rollout"}  # a stage module is its own: no stage imports another
    assert edit("rlhf/engines/vllm_engine.py") == {"rollout", "ppo", "grpo"}  # both sample through it
    assert edit("rlhf/train/rl_loop.py") == {"ppo", "grpo"}
    assert edit("rlhf/train/remote.py") == {"ppo", "grpo"}  # a Ray engine actor: the RL loop only
    after = versions(tmp_path)
    for rel in ("rlhf/ops/report.py", "rlhf/cli/main.py"):  # nothing a stage runs
        with open(tmp_path / rel, "a") as f:
            f.write("# a comment\n")
    assert versions(tmp_path) == after

    with open(tmp_path / "rlhf" / "maths" / "rl_math.py", "a") as f:
        f.write("# a comment\n")
    assert {s for s, v in versions(tmp_path).items() if v != after[s]} >= {"ppo", "grpo"}
    with open(tmp_path / "rlhf" / "core" / "store.py", "a") as f:  # the runner imports it: every stage
        f.write("# a comment\n")
    final = versions(tmp_path)
    assert all(final[s] != after[s] for s in SPECS)


def test_imports_inside_functions_and_from_package_imports_count(tmp_path):
    (tmp_path / "rlhf").mkdir()
    for name in ("__init__", "a", "b", "c"):
        (tmp_path / "rlhf" / f"{name}.py").write_text("")
    source = "import os\nfrom rlhf import a\ndef f():\n    import rlhf.b\n    from rlhf.c import thing\n"
    assert codehash.imported_files(source, tmp_path) == {"rlhf/__init__.py", "rlhf/a.py", "rlhf/b.py", "rlhf/c.py"}
