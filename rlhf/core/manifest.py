"""A stage's manifest: the JSON record the runner writes last into the stage's prefix (present: the stage
is complete). Typed here, and checked on every read, because the store is shared: a manifest another
machine, an older version or a hostile hand wrote must fail with one line naming the file and the field,
not with a KeyError deep inside a later stage.

Fields older versions did not write (shared, ledger, timings, ...) may be absent; a field that is present
must have its type.
"""

from __future__ import annotations

import re
from typing import Any, TypedDict

SCHEMA_VERSION = 1
KEY = re.compile(r"[0-9a-f]{8,128}")  # content keys are sha256 hex digests


class Manifest(TypedDict, total=False):
    schema_version: int
    run: str
    stage: str
    key: str  # the content key: what the outputs are a function of
    inputs: dict[str, str]  # input stage -> its content key
    config: dict[str, Any]  # the stage's config section
    shared: dict[str, Any]  # other config sections in its key
    model: dict[str, Any]
    data: dict[str, Any]
    seed: int
    code_version: str  # one hash of `code`
    code: dict[str, str]  # project file -> digest of its bytes (the stage's import closure)
    functions: dict[str, dict[str, str]]  # user function 'module:function' -> {its module files: digest}
    packages: dict[str, str]  # versions of the numeric packages in its key
    environment: dict[str, str]  # versions of the main packages installed (a record, not in the key)
    outputs: dict[str, str]  # artifact name -> path relative to the stage prefix (or the store root)
    rows: dict[str, int]
    metrics: dict[str, float]
    resumed_from_step: int | None
    timings: dict[str, Any]
    ledger: dict[str, Any]
    status: str  # added by the runner to what it returns (skipped | resumed | ran), never stored


class ManifestError(ValueError):
    pass


REQUIRED = ("run", "stage", "key", "inputs", "outputs", "rows", "metrics")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:  # NaN included: a metric with nothing to measure (no held-out prompts) is NaN
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _mapping(value, check) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and check(v) for k, v in value.items())


# field -> (test, what it must be)
FIELDS = {
    "schema_version": (lambda v: v == SCHEMA_VERSION, f"the number {SCHEMA_VERSION}"),
    "run": (lambda v: isinstance(v, str), "a string"),
    "stage": (lambda v: isinstance(v, str), "a string"),
    "key": (lambda v: isinstance(v, str) and KEY.fullmatch(v) is not None, "a hex content key"),
    "inputs": (lambda v: _mapping(v, lambda k: isinstance(k, str) and KEY.fullmatch(k) is not None),
               "a mapping of stage names to hex content keys"),
    "config": (lambda v: isinstance(v, dict), "a mapping"),
    "shared": (lambda v: isinstance(v, dict), "a mapping"),
    "model": (lambda v: isinstance(v, dict), "a mapping"),
    "data": (lambda v: isinstance(v, dict), "a mapping"),
    "seed": (_is_int, "an integer"),
    "code_version": (lambda v: isinstance(v, str), "a string"),
    "packages": (lambda v: _mapping(v, lambda x: isinstance(x, str)), "a mapping of package names to versions"),
    "environment": (lambda v: _mapping(v, lambda x: isinstance(x, str)), "a mapping of package names to versions"),
    "functions": (lambda v: _mapping(v, lambda x: _mapping(x, lambda y: isinstance(y, str))),
                  "a mapping of functions to {file: digest}"),
    "code": (lambda v: _mapping(v, lambda x: isinstance(x, str)), "a mapping of files to digests"),
    "outputs": (lambda v: _mapping(v, lambda x: isinstance(x, str) and x != ""), "a mapping of names to relative paths"),
    "rows": (lambda v: _mapping(v, _is_int), "a mapping of names to integers"),
    "metrics": (lambda v: _mapping(v, _is_number), "a mapping of names to numbers"),
    "resumed_from_step": (lambda v: v is None or _is_int(v), "an integer or null"),
    "timings": (lambda v: isinstance(v, dict), "a mapping"),
    "ledger": (lambda v: isinstance(v, dict), "a mapping"),
}


def check(obj: Any, where: str) -> Manifest:
    """`obj` as a Manifest, or ManifestError naming `where` (the file) and every field that is wrong.
    (A stage folder copied under another run name keeps its manifest's `run`: forking a run that way is
    allowed, so the location is not compared.)"""
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}: not a manifest (a JSON object), got {type(obj).__name__}")
    problems = [f"'{f}' is missing" for f in REQUIRED if f not in obj]
    problems += [f"'{f}' must be {what}" for f, (test, what) in FIELDS.items() if f in obj and not test(obj[f])]
    if problems:
        raise ManifestError(f"{where}: invalid manifest: " + "; ".join(problems))
    return obj  # type: ignore[return-value]
