"""User data in TRL's standard formats, validated row by row before any model is loaded.

Accepted: JSONL, Parquet, or a Hugging Face dataset name (train split, where there is network).
Formats (https://huggingface.co/docs/trl/dataset_formats), plain strings or conversational messages:
  sft:   {prompt, completion} or {messages}
  prefs: {prompt, chosen, rejected} or implicit-prompt {chosen, rejected}
  unpaired: {prompt, completion, label} with label true (desirable) or false (KTO's unpaired format)
Errors name the file, the 1-based line (JSONL) or row (Parquet / hub), and the column.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

Kind = Literal["sft", "prefs", "unpaired"]
COLUMNS: dict[str, list[tuple[str, ...]]] = {
    "sft": [("prompt", "completion"), ("messages",)],
    "prefs": [("prompt", "chosen", "rejected"), ("chosen", "rejected")],
    "unpaired": [("prompt", "completion", "label")],
}
FLAGS = {"label"}  # boolean columns; every other column holds text


class DataError(Exception):
    pass


def _read_rows(source: str) -> tuple[list[Any], str]:
    """Returns (rows, unit) where unit is 'line' for JSONL and 'row' otherwise."""
    path = Path(source)
    if source.endswith((".jsonl", ".json")):
        if not path.is_file():
            raise DataError(f"{source}: file not found")
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                rows.append(None)  # keeps line numbers aligned; reported as an empty line
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{source} line {n}: not valid JSON ({e.msg})") from None
        return rows, "line"
    if source.endswith(".parquet"):
        if not path.is_file():
            raise DataError(f"{source}: file not found")
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist(), "row"
    import datasets  # a hub dataset name; needs network, which the default profile never does

    return list(datasets.load_dataset(source, split="train")), "row"


def _text_problem(value: Any, column: str) -> str | None:
    """None when `value` is a usable string or message list, else what is wrong with it."""
    if isinstance(value, str):
        return None if value.strip() else f"{column!r} is empty"
    if isinstance(value, list):
        if not value:
            return f"{column!r} is an empty message list"
        for i, msg in enumerate(value):
            if not isinstance(msg, dict) or not {"role", "content"} <= msg.keys():
                return f"{column!r} message {i} needs 'role' and 'content'"
            if not isinstance(msg["content"], str) or not msg["content"].strip():
                return f"{column!r} message {i} has empty content"
        return None
    if value is None:
        return f"{column!r} is missing"
    return f"{column!r} must be a string or a list of messages, got {type(value).__name__}"


def row_problem(row: Any, kind: Kind) -> str | None:
    if not isinstance(row, dict):
        return "empty line" if row is None else f"expected an object, got {type(row).__name__}"
    layouts = COLUMNS[kind]
    layout = next((cols for cols in layouts if set(cols) <= row.keys()), None)
    if layout is None:
        wanted = " or ".join("{" + ", ".join(c) + "}" for c in layouts)
        return f"missing columns: expected {wanted}, got {sorted(row)}"
    for col in layout:
        if col in FLAGS:
            if not isinstance(row[col], bool):
                return f"{col!r} must be true or false, got {row[col]!r}"
            continue
        problem = _text_problem(row[col], col)
        if problem:
            return problem
    if kind == "prefs" and row["chosen"] == row["rejected"]:
        return "'chosen' and 'rejected' are identical"
    return None


def shape(row: dict, kind: Kind) -> tuple:
    """(columns used, conversational?) of a valid row: every row of one file must share it, since a
    dataset mixing layouts or plain text with message lists cannot become one Arrow table."""
    layout = next(cols for cols in COLUMNS[kind] if set(cols) <= row.keys())
    text = [c for c in layout if c not in FLAGS]
    return layout, isinstance(row[text[-1]], list)


def load_rows(
    source: str, kind: Kind, on_bad_row: Literal["fail", "drop"] = "fail", keep_index: bool = False
) -> tuple[list, list[str]]:
    """Validated rows plus the list of dropped-row messages (empty unless on_bad_row='drop').
    With keep_index, rows come as (1-based row number, row) pairs."""
    rows, unit = _read_rows(source)
    good, dropped = [], []
    for n, row in enumerate(rows, start=1):
        problem = row_problem(row, kind)
        if problem is None and good:
            first = shape(good[0][1] if keep_index else good[0], kind)
            if shape(row, kind) != first:
                problem = f"row layout {shape(row, kind)} differs from the first valid row's {first}"
        if problem is None:
            good.append((n, row) if keep_index else row)
            continue
        message = f"{source} {unit} {n}: {problem}"
        if on_bad_row == "fail":
            raise DataError(message)
        dropped.append(message)
    if not good:
        raise DataError(f"{source}: no usable rows for {kind} data ({len(dropped)} dropped)")
    return good, dropped
