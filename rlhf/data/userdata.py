"""User data in TRL's standard formats, validated row by row before any model is loaded.

Accepted: JSONL, Parquet, or a Hugging Face dataset name (train split, where there is network).
Formats (https://huggingface.co/docs/trl/dataset_formats), plain strings or conversational messages:
  sft:   {prompt, completion} or {messages}
  prefs: {prompt, chosen, rejected} or implicit-prompt {chosen, rejected}
  unpaired: {prompt, completion, label} with label true (desirable) or false (KTO's unpaired format)
  prompts: {prompt, ...any other columns} (the RL stages', preferences', rollouts' and eval's prompts; a
           conversational prompt ends with the user's turn)
A saved Hugging Face dataset folder (`save_to_disk`) reads too. Message roles are system, user and
assistant (the roles chat templates render; any other would be rendered verbatim as a turn).
Errors name the file, the 1-based line (JSONL) or row (Parquet / hub), and the column.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

Kind = Literal["sft", "prefs", "unpaired", "prompts"]
COLUMNS: dict[str, list[tuple[str, ...]]] = {
    "sft": [("prompt", "completion"), ("messages",)],
    "prefs": [("prompt", "chosen", "rejected"), ("chosen", "rejected")],
    "unpaired": [("prompt", "completion", "label")],
    "prompts": [("prompt",)],
}
ROLES = ("system", "user", "assistant")
FLAGS = {"label"}  # boolean columns; every other column holds text


class DataError(Exception):
    pass


def sift(items: list, problem_of, on_bad_row: str, log, what: str, hint: str = "", error: type = DataError
         ) -> tuple[list, list[str]]:
    """(items without a problem, the problems): the screening a stage does once rows are tokenized (a prompt
    or pair longer than its max_length). `problem_of(item)` names an item's problem or returns None.
    data.on_bad_row fail raises naming the first ten; drop warns for each and counts; none left raises."""
    if not items:
        raise error(f"there are no {what} to screen")
    kept, problems = [], []
    for item in items:
        problem = problem_of(item)
        if problem is None:
            kept.append(item)
        else:
            problems.append(problem)
    if problems and (on_bad_row == "fail" or not kept):
        why = "data.on_bad_row: fail" if kept else "none left"
        shown = "\n  ".join(problems[:10])
        raise error(f"{len(problems)} of {len(items)} {what} are unusable ({why}{hint}):\n  {shown}")
    for p in problems:
        log.warning("dropped %s", p)
    return kept, problems


class BadLine:
    """A JSONL line that is not a JSON value: reported (fail) or counted (drop) like any bad row."""

    def __init__(self, problem: str):
        self.problem = problem


def _parse_line(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadLine(f"not valid UTF-8 (byte {e.start})")
    if not text.strip():
        return None  # keeps line numbers aligned; reported as an empty line
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return BadLine(f"not valid JSON ({e.msg})")
    except RecursionError:
        return BadLine("not valid JSON (nested too deeply)")


def _read_rows(source: str) -> tuple[list[Any], str]:
    """Returns (rows, unit) where unit is 'line' for JSONL and 'row' otherwise."""
    path = Path(source)
    if source.endswith((".jsonl", ".json")):
        if not path.is_file():
            raise DataError(f"{source}: file not found")
        return [_parse_line(line) for line in path.read_bytes().splitlines()], "line"
    if source.endswith(".parquet"):
        if not path.is_file():
            raise DataError(f"{source}: file not found")
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist(), "row"
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{source}: not a readable Parquet file ({str(e).splitlines()[0][:200]})") from None
    import datasets

    if path.is_dir():  # saved with save_to_disk: a Dataset, or a DatasetDict whose "train" split we read
        loaded = datasets.load_from_disk(source)
        return list(loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded), "row"
    # a hub dataset name; needs network, which the default profile never does
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
            if msg["role"] not in ROLES:
                return f"{column!r} message {i} has role {str(msg['role'])[:40]!r}; roles are {', '.join(ROLES)}"
            if not isinstance(msg["content"], str):
                return f"{column!r} message {i} content must be a string, got {type(msg['content']).__name__}"
            if not msg["content"].strip():
                return f"{column!r} message {i} has empty content"
        return None
    if value is None:
        return f"{column!r} is missing"
    return f"{column!r} must be a string or a list of messages, got {type(value).__name__}"


def _value_problem(value: Any, column: str) -> str | None:
    """A gold answer or a completion column: non-empty text, or a number."""
    if isinstance(value, str):
        return None if value.strip() else f"{column!r} is empty"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return None
    return f"{column!r} must be text or a number, got {type(value).__name__}"


def row_problem(row: Any, kind: Kind, required: tuple[str, ...] = ()) -> str | None:
    if isinstance(row, BadLine):
        return row.problem
    if not isinstance(row, dict):
        return "empty line" if row is None else f"expected an object, got {type(row).__name__}"
    try:  # JSON's \ud800 escapes decode to lone surrogates, which no Arrow string or tokenizer accepts
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return "not valid Unicode text (a lone surrogate escape such as \\ud800)"
    except (TypeError, ValueError, RecursionError):  # Parquet rows with bytes or nesting JSON cannot hold
        pass
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
    if kind == "prompts" and isinstance(row["prompt"], list) and row["prompt"][-1]["role"] != "user":
        return f"'prompt' must end with the user's turn (the answer follows it), got {row['prompt'][-1]['role']!r}"
    for col in required:
        if col not in row:
            return f"no {col!r} column (columns: {', '.join(sorted(row))})"
        if problem := _value_problem(row[col], col):
            return problem
    return None


def shape(row: dict, kind: Kind) -> tuple:
    """(columns used, conversational?) of a valid row: every row of one file must share it, since a
    dataset mixing layouts or plain text with message lists cannot become one Arrow table."""
    layout = next(cols for cols in COLUMNS[kind] if set(cols) <= row.keys())
    text = [c for c in layout if c not in FLAGS]
    return layout, isinstance(row[text[-1]], list)


def load_rows(
    source: str, kind: Kind, on_bad_row: Literal["fail", "drop"] = "fail", keep_index: bool = False,
    required: tuple[str, ...] = (),
) -> tuple[list, list[str]]:
    """Validated rows plus the list of dropped-row messages (empty unless on_bad_row='drop').
    With keep_index, rows come as (1-based row number, row) pairs. `required`: further columns every row
    must hold (text or a number), e.g. the gold answers the verifier reads."""
    rows, unit = _read_rows(source)
    good, dropped = [], []
    for n, row in enumerate(rows, start=1):
        problem = row_problem(row, kind, required)
        if problem is None and good and kind != "prompts":  # each prompt is rendered on its own, never one table
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
