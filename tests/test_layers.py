"""The package layers and the direction of imports (docs/architecture.md, "Layout").

Read from the source with `ast`, every import at any depth (imports inside functions count: a lazy import
is still a dependency), except under `if TYPE_CHECKING:` (annotations only, never executed).
"""

from __future__ import annotations

import ast

from conftest import REPO

# low to high; a module may import its own layer and the layers below it
LAYERS = ("maths", "core", "data", "engines", "train", "stages", "pipeline", "ops", "flows")
# the CLI starts flows and deploys them; services run Prefect's server and workers
MAY_IMPORT_FLOWS_AND_PREFECT = {"rlhf/ops/cli.py", "rlhf/ops/services.py"}


def project_files() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for top in ("rlhf", "stages", "flows") for p in (REPO / top).rglob("*.py"))


def layer(rel: str) -> str | None:
    parts = rel.split("/")
    if parts[0] in ("stages", "flows"):
        return parts[0]
    return parts[1] if len(parts) > 2 else None  # rlhf/__init__.py belongs to no layer


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(rel: str) -> tuple[set[str], set[str]]:
    """(project files, third-party top-level names) that `rel` imports, outside TYPE_CHECKING blocks."""
    files, others = set(), set()
    todo = [ast.parse((REPO / rel).read_text())]
    while todo:
        node = todo.pop()
        if _type_checking(node):
            todo += node.orelse
            continue
        todo += ast.iter_child_nodes(node)
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        for name in names:
            base = name.replace(".", "/")
            found = [f for f in (f"{base}.py", f"{base}/__init__.py") if (REPO / f).is_file()]
            if found:
                files.update(found)
            elif name.split(".")[0] not in ("rlhf", "stages", "flows"):
                others.add(name.split(".")[0])
    files.discard(rel)
    return {f for f in files if not f.endswith("__init__.py")}, others


GRAPH = {rel: imports(rel) for rel in project_files()}


def test_every_module_sits_in_a_layer():
    assert {layer(f) for f in GRAPH} - {None} == set(LAYERS)
    assert [f for f in GRAPH if layer(f) is None] == ["rlhf/__init__.py"]


def test_imports_point_down_the_layers():
    wrong = []
    for rel, (files, _) in GRAPH.items():
        for dep in files:
            if LAYERS.index(layer(dep)) > LAYERS.index(layer(rel)):
                if not (rel in MAY_IMPORT_FLOWS_AND_PREFECT and layer(dep) == "flows"):
                    wrong.append(f"{rel} imports {dep}")
    assert wrong == []


def test_maths_imports_nothing_of_ours_and_stages_never_import_stages():
    assert [(f, d) for f, (deps, _) in GRAPH.items() if layer(f) == "maths" for d in deps] == []
    assert [(f, d) for f, (deps, _) in GRAPH.items() if layer(f) == "stages" for d in deps if layer(d) == "stages"] == []


def test_prefect_only_in_flows_the_cli_and_services():
    users = {f for f, (_, others) in GRAPH.items() if "prefect" in others}
    assert users and users <= {f for f in GRAPH if layer(f) == "flows"} | MAY_IMPORT_FLOWS_AND_PREFECT


def test_no_import_cycle():
    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), list(GRAPH[start][0])
        while todo:
            f = todo.pop()
            if f == goal:
                return True
            if f not in seen:
                seen.add(f)
                todo += GRAPH[f][0]
        return False

    assert [f for f in GRAPH if reaches(f, f)] == []


def test_the_checks_see_a_violation(tmp_path, monkeypatch):
    # the walker must find an import inside a function and skip one under TYPE_CHECKING
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlhf.ops import cli\ndef f():\n    from rlhf.pipeline import runner\n"
    (tmp_path / "rlhf" / "maths").mkdir(parents=True)
    (tmp_path / "rlhf" / "maths" / "x.py").write_text(src)
    for rel in ("rlhf/ops/cli.py", "rlhf/pipeline/runner.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    assert imports("rlhf/maths/x.py") == ({"rlhf/pipeline/runner.py"}, {"typing"})


def test_no_flow_file_is_named_like_a_package_of_ours():
    # Prefect loads a deployment's entrypoint as a module named after its file: flows/rlhf.py would become
    # `rlhf` in the flow-run process and hide every rlhf.* module not imported yet
    assert {p.stem for p in (REPO / "flows").glob("*.py")} & {"rlhf", "stages", "flows"} == set()
