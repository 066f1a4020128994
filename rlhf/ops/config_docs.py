"""docs/configuration.md, generated from the config models: every key with its type, default, bounds and
meaning. The meaning is the comment beside (or just above) the field in rlhf/core/config.py, so the models stay
the one source. Regenerate with `python -m rlhf.ops.config_docs > docs/configuration.md`;
tests/test_config_docs.py fails when the committed file is stale.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

from annotated_types import Ge, Gt, Le, Lt
import typing

from pydantic import BaseModel

from rlhf.core import config as config_module
from rlhf.core.config import PipelineConfig

SOURCE = Path(config_module.__file__)
BOUNDS = ((Ge, ">="), (Gt, ">"), (Le, "<="), (Lt, "<"))


def _comments(source: str) -> dict[int, str]:
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def field_sources() -> dict[tuple[str, str], tuple[str, str]]:
    """(class, field) -> (annotation as written, meaning from the comments)."""
    source = SOURCE.read_text()
    comments, lines = _comments(source), source.splitlines()
    out = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            meaning = [comments[stmt.end_lineno]] if stmt.end_lineno in comments else []
            above, line = [], stmt.lineno - 1
            while line in comments and lines[line - 1].lstrip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            out[(node.name, stmt.target.id)] = (ast.get_source_segment(source, stmt.annotation), " ".join(above + meaning))
    return out


def _defined_in(model: type[BaseModel], name: str, sources) -> tuple[str, str]:
    for cls in model.__mro__:
        if (cls.__name__, name) in sources:
            return sources[(cls.__name__, name)]
    return ("", "")


def _bounds(info) -> str:
    return ", ".join(f"{op} {getattr(m, type(m).__name__.lower())}" for m in info.metadata
                     for kind, op in BOUNDS if isinstance(m, kind))


def _default(info) -> str:
    if info.is_required():
        return "required"
    value = info.default_factory() if info.default_factory is not None else info.default
    if isinstance(value, str):
        return f"`{value!r}`" if value else "`''`"
    return f"`{value}`" if value is not None else "`null`"


def rows(model: type[BaseModel], prefix: str, sources) -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        key = f"{prefix}.{info.alias or name}"  # as users write it (`rollout.async`, a Python keyword)
        nested = info.annotation if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel) else None
        annotation, meaning = _defined_in(model, name, sources)
        if nested is not None:
            out += rows(nested, key, sources)
            continue
        args = typing.get_args(info.annotation)
        optional = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)] if type(None) in args else []
        if optional:  # an optional section (null: off): its row, then its keys
            out.append(f"| `{key}` | `{optional[0].__name__} \\| None` | `null` |  | {meaning.replace('|', chr(92) + '|')} |")
            out += rows(optional[0], key, sources)
            continue
        cells = [f"`{key}`", f"`{annotation}`".replace("|", "\\|"), _default(info).replace("|", "\\|"),
                 _bounds(info), meaning.replace("|", "\\|")]
        out.append("| " + " | ".join(cells) + " |")
    return out


def render() -> str:
    sources = field_sources()
    parts = [
        "# Configuration reference",
        "",
        "Generated from `rlhf/core/config.py` by `python -m rlhf.ops.config_docs > docs/configuration.md`; do not edit by",
        "hand (tests/test_config_docs.py fails when this file is stale). Every key can be set in pipeline.yaml,",
        "in a profile under `profiles:`, or with `--set key.path=value`. Unknown keys are errors. The defaults",
        "here are the models' own; the shipped pipeline.yaml sets its own values for the default and tiny",
        "profiles (`rlhf validate` prints the resolved result).",
        "",
    ]
    for name, info in PipelineConfig.model_fields.items():
        model = info.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        doc = " ".join((model.__doc__ or "").split())
        parts += [f"## `{name}`", ""] + ([doc, ""] if doc else [])
        parts += ["| key | type | default | bounds | meaning |", "|---|---|---|---|---|"]
        parts += rows(model, name, sources) + [""]
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
