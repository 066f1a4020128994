"""`rlhf diff RUN_A RUN_B`: per stage, whether the two runs' results differ and why, from their manifests.

A stage's content key hashes its identity (rlhf/pipeline/identity.py); each manifest records it, so a
differing key is explained by the parts that differ, as `rlhf validate` explains a stage that will rerun:
changed config values (key path, old and new), a data file's content, the model's weights, a package
version, a code file, a user function's source, or an upstream stage whose key changed. Final metrics are
shown side by side. Manifests come from a shared store: values are shown cut to one short line.
"""

from __future__ import annotations

from rlhf.pipeline.identity import explain, shown

def stage_diff(stage: str, a: dict | None, b: dict | None) -> dict:
    """{stage, status: same | differs | only in A | only in B | missing, reasons: [...], metrics: [(name, a, b)]}."""
    if a is None or b is None:
        status = "missing" if a is None and b is None else ("only in B" if a is None else "only in A")
        return {"stage": stage, "status": status, "reasons": [], "metrics": []}
    metrics = [(k, a.get("metrics", {}).get(k), b.get("metrics", {}).get(k))
               for k in sorted({*a.get("metrics", {}), *b.get("metrics", {})})]
    if a.get("key") == b.get("key"):
        return {"stage": stage, "status": "same", "reasons": [], "metrics": metrics}
    reasons = explain(stage, a, b)
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
