"""`rlhf diff RUN_A RUN_B`: per stage, whether the two runs' results differ and why, from their manifests.

A stage's content key hashes its config block, the config sections it also reads, the model identity,
the data config, the seed, its inputs' keys and its code version (rlhf/pipeline/runner.py); each manifest
records those parts, so a differing key is explained by the parts that differ: changed config values
(key path, old and new), a new code version, or an upstream stage whose key changed. Final metrics are
shown side by side. Manifests come from a shared store: values are shown cut to one short line.
"""

from __future__ import annotations

from typing import Any

# manifest field -> how its key paths are named in the explanation ("" : the stage's own section)
PARTS = {"config": "", "shared": "", "model": "model", "data": "data", "seed": "run.seed"}


def flatten(value: Any, prefix: str) -> dict[str, Any]:
    """{'a': {'b': 1}, 'c': [1]} under 'x' -> {'x.a.b': 1, 'x.c': [1]} (lists stay values)."""
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for k, v in value.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def shown(value: Any) -> str:
    text = repr(value).replace("\n", "\\n")
    return text if len(text) <= 60 else text[:57] + "..."


def _parts(stage: str, manifest: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field, name in PARTS.items():
        if field not in manifest:
            continue
        value = manifest[field]
        if field == "config":
            out.update(flatten(value, stage))
        elif field == "shared":  # {section: block} of other stages' sections this one reads
            out.update(flatten(value if isinstance(value, dict) else {}, ""))
        else:
            out.update(flatten(value, name))
    return out


def stage_diff(stage: str, a: dict | None, b: dict | None) -> dict:
    """{stage, status: same | differs | only in A | only in B | missing, reasons: [...], metrics: [(name, a, b)]}."""
    if a is None or b is None:
        status = "missing" if a is None and b is None else ("only in B" if a is None else "only in A")
        return {"stage": stage, "status": status, "reasons": [], "metrics": []}
    metrics = [(k, a.get("metrics", {}).get(k), b.get("metrics", {}).get(k))
               for k in sorted({*a.get("metrics", {}), *b.get("metrics", {})})]
    if a.get("key") == b.get("key"):
        return {"stage": stage, "status": "same", "reasons": [], "metrics": metrics}
    reasons = []
    pa, pb = _parts(stage, a), _parts(stage, b)
    for path in sorted({*pa, *pb}):
        va, vb = pa.get(path, "(unset)"), pb.get(path, "(unset)")
        if va != vb:
            reasons.append(f"{path}: {shown(va)} -> {shown(vb)}")
    if a.get("code_version") != b.get("code_version"):
        reasons.append(f"code version: {shown(a.get('code_version'))} -> {shown(b.get('code_version'))}")
    ia, ib = a.get("inputs") or {}, b.get("inputs") or {}
    for up in sorted({*ia, *ib}):
        if ia.get(up) != ib.get(up):
            reasons.append(f"upstream {up}: its key changed")
    if not reasons:
        reasons.append("the keys differ but no recorded part does (manifests written by different versions?)")
    return {"stage": stage, "status": "differs", "reasons": reasons, "metrics": metrics}


def diff_runs(manifests_a: dict[str, dict], manifests_b: dict[str, dict], order: list[str]) -> list[dict]:
    """stage_diff for every stage either run has, in DAG order."""
    return [stage_diff(s, manifests_a.get(s), manifests_b.get(s)) for s in order if s in manifests_a or s in manifests_b]


def render(run_a: str, run_b: str, diffs: list[dict], ratings: dict[str, list[dict]]) -> str:
    """Plain text: per stage its status, the reasons, the final metrics side by side; then eval's Elo
    with 95% intervals for both runs where each has them."""
    lines = [f"# {run_a} (A) vs {run_b} (B)"]
    for d in diffs:
        lines.append(f"\n{d['stage']}: {d['status']}")
        lines += [f"  {r}" for r in d["reasons"]]
        for name, va, vb in d["metrics"]:
            fa = f"{va:.4g}" if isinstance(va, (int, float)) else shown(va)
            fb = f"{vb:.4g}" if isinstance(vb, (int, float)) else shown(vb)
            lines.append(f"  {name}: {fa} | {fb}")
    if any(ratings.values()):
        lines.append("\neval Elo [95% CI]: A | B")
        keyed = {run: {(r["judge"], r["policy"]): r for r in rows} for run, rows in ratings.items()}
        for judge, policy in sorted({k for rows in keyed.values() for k in rows}):
            cells = []
            for run in (run_a, run_b):
                r = keyed.get(run, {}).get((judge, policy))
                cells.append(f"{r['elo']:.0f} [{r['ci_low']:.0f}, {r['ci_high']:.0f}]" if r else "-")
            lines.append(f"  {judge} / {policy}: {cells[0]} | {cells[1]}")
    return "\n".join(lines)
