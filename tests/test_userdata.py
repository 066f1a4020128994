"""User data in TRL's formats: row-level errors name the file, the line and the column."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf.data.userdata import DataError, load_rows


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_good_plain_and_conversational_rows(tmp_path):
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "2+2=", "chosen": "4", "rejected": "5"}] * 2)
    implicit = write_jsonl(
        tmp_path / "implicit.jsonl",
        [{"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
          "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go away"}]}],
    )
    for src, n in ((plain, 2), (implicit, 1)):
        rows, dropped = load_rows(src, "prefs")
        assert len(rows) == n and dropped == []


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt": "p", "chosen": "", "rejected": "x"}, "line 2: 'chosen' is empty"),
        ({"prompt": "p", "chosen": "a"}, "line 2: missing columns: expected {prompt, chosen, rejected} or {chosen, rejected}"),
        ({"prompt": "p", "chosen": "a", "rejected": "a"}, "line 2: 'chosen' and 'rejected' are identical"),
        ({"prompt": "p", "chosen": [{"role": "assistant"}], "rejected": "b"}, "line 2: 'chosen' message 0 needs 'role' and 'content'"),
        ({"prompt": 3, "chosen": "a", "rejected": "b"}, "line 2: 'prompt' must be a string or a list of messages, got int"),
        ("{not json", "line 2: not valid JSON"),
        ({"prompt": [{"role": "user", "content": "p"}], "chosen": [{"role": "assistant", "content": "a"}],
          "rejected": [{"role": "assistant", "content": "b"}]}, "line 2: row layout"),
    ],
)
def test_bad_row_is_reported_with_file_and_line(tmp_path, bad, message):
    src = write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}, bad])
    with pytest.raises(DataError) as e:
        load_rows(src, "prefs")
    assert str(e.value) == f"{src} {message}" or str(e.value).startswith(f"{src} {message}")


def test_drop_mode_counts_and_reports(tmp_path):
    src = write_jsonl(
        tmp_path / "sft.jsonl",
        [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": " "}, {"messages": []}, {"prompt": "c", "completion": "d"}],
    )
    rows, dropped = load_rows(src, "sft", on_bad_row="drop")
    assert len(rows) == 2
    assert dropped == [f"{src} line 2: 'completion' is empty", f"{src} line 3: 'messages' is an empty message list"]


def test_parquet_rows_are_numbered(tmp_path):
    path = tmp_path / "sft.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "completion": ["x", ""]}), path)
    with pytest.raises(DataError, match=r"sft.parquet row 2: 'completion' is empty"):
        load_rows(str(path), "sft")


def test_missing_file_and_all_rows_bad(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        load_rows(str(tmp_path / "nope.jsonl"), "sft")
    src = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "", "completion": ""}])
    with pytest.raises(DataError, match="no usable rows"):
        load_rows(src, "sft", on_bad_row="drop")


def test_shipped_example_files_are_valid():
    from conftest import REPO

    prefs, dropped = load_rows(str(REPO / "data" / "examples" / "prefs.jsonl"), "prefs")
    assert len(prefs) == 5 and dropped == []
    sft, dropped = load_rows(str(REPO / "data" / "examples" / "sft.jsonl"), "sft")
    assert len(sft) == 4 and dropped == []


def test_sift_drops_or_fails_and_never_returns_nothing():
    import logging

    from rlhf.data.userdata import sift

    log, odd = logging.getLogger("test"), (lambda n: f"item {n}: odd" if n % 2 else None)
    assert sift([2, 3, 4, 5], odd, "drop", log, "numbers") == ([2, 4], ["item 3: odd", "item 5: odd"])
    with pytest.raises(DataError, match=r"^2 of 4 numbers are unusable \(data.on_bad_row: fail; see x\):\n  item 3: odd\n  item 5"):
        sift([2, 3, 4, 5], odd, "fail", log, "numbers", hint="; see x")
    with pytest.raises(DataError, match=r"^2 of 2 numbers are unusable \(none left\)"):
        sift([1, 3], odd, "drop", log, "numbers")
    with pytest.raises(ValueError, match="there are no numbers to screen"):
        sift([], odd, "drop", log, "numbers", error=ValueError)
    assert sift([2], odd, "fail", log, "numbers") == ([2], [])
