"""Content keys hash exactly the code a stage runs: the files its module (and the runner) import."""

from __future__ import annotations

import shutil

from conftest import REPO
from rlhf import codehash
from rlhf.runner import STAGE_MODULES


def versions(root) -> dict[str, str]:
    codehash.code_files.cache_clear()
    return {s: codehash.code_version(m.replace(".", "/") + ".py", root) for s, m in STAGE_MODULES.items()}


def test_an_edit_changes_the_keys_of_exactly_the_stages_that_import_it(tmp_path):
    for package in ("rlhf", "stages"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    before = versions(tmp_path)
    assert before == versions(REPO)  # same files, same versions: the hash does not depend on the folder

    with open(tmp_path / "stages" / "rollout.py", "a") as f:
        f.write("# a comment\n")
    after = versions(tmp_path)
    changed = {s for s in before if before[s] != after[s]}
    assert changed == {"rollout", "ppo", "grpo"}  # the RL loop samples through stages/rollout.py

    for rel in ("rlhf/report.py", "rlhf/cli.py"):  # nothing a stage runs
        with open(tmp_path / rel, "a") as f:
            f.write("# a comment\n")
    assert versions(tmp_path) == after

    with open(tmp_path / "rlhf" / "rl_math.py", "a") as f:
        f.write("# a comment\n")
    assert {s for s, v in versions(tmp_path).items() if v != after[s]} >= {"ppo", "grpo"}
    with open(tmp_path / "rlhf" / "store.py", "a") as f:  # the runner imports it: every stage
        f.write("# a comment\n")
    final = versions(tmp_path)
    assert all(final[s] != after[s] for s in STAGE_MODULES)


def test_imports_inside_functions_and_from_package_imports_count(tmp_path):
    (tmp_path / "rlhf").mkdir()
    for name in ("__init__", "a", "b", "c"):
        (tmp_path / "rlhf" / f"{name}.py").write_text("")
    source = "import os\nfrom rlhf import a\ndef f():\n    import rlhf.b\n    from rlhf.c import thing\n"
    assert codehash.imported_files(source, tmp_path) == {"rlhf/__init__.py", "rlhf/a.py", "rlhf/b.py", "rlhf/c.py"}
