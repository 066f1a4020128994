"""`rlhf report RUN`: a self-contained folder (report.md + PNG plots) for one run, built from the store.

Per stage: status (complete / in progress with checkpoints / not run), wall time, content key, resume point
and artifact URLs; training curves from each stage's metrics.parquet (loss, rewards, KL, clip fraction,
value loss, accuracy...); the Elo chart and leaderboard of the eval stage. Written with the manifests as
the source of truth: a stage without a manifest is never reported as complete.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from rlhf.core.registry import NAMES as STAGES, output_path
from rlhf.core.manifest import ManifestError
from rlhf.core.store import ATTEMPT, ArtifactStore
from rlhf.core.tables import METRICS_SCHEMA

# Plotted first when present, in this order; other metrics follow up to MAX_PANELS per stage.
PREFERRED = ("loss", "reward_mean", "kl", "rewards/margins", "rewards/accuracies", "accuracy", "clip_fraction",
             "value_loss", "entropy", "response_length", "grad_norm")
SKIPPED = {"learning_rate", "epoch", "num_tokens", "beta", "tokens_per_s"}
MAX_PANELS = 8


def stage_status(store: ArtifactStore, run: str, stage: str) -> tuple[str, dict | None]:
    try:
        manifest = store.read_manifest(run, stage)
    except ManifestError as e:
        return f"invalid manifest ({e})", None
    if manifest is not None:
        return "complete", manifest
    if store.read_json(store.stage_path(run, stage, ATTEMPT)) is not None:
        return "incomplete (attempt started, no manifest)", None
    return "not run", None


def curves(table: pa.Table) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for row in table.to_pylist():
        if row["value"] is not None and row["name"] not in SKIPPED:
            series.setdefault(row["name"], []).append((row["step"], row["value"]))
    series = {k: sorted(v) for k, v in series.items() if len(v) >= 2}
    order = [n for n in PREFERRED if n in series] + sorted(n for n in series if n not in PREFERRED)
    return {n: series[n] for n in order[:MAX_PANELS]}


def plot_curves(stage: str, series: dict[str, list[tuple[int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(series))
    rows = -(-len(series) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), squeeze=False)
    for ax, (name, points) in zip(axes.flat, series.items()):
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", linewidth=1)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("iteration" if stage in ("ppo", "grpo") else "step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(series):]:
        ax.axis("off")
    fig.suptitle(f"{stage}: training curves", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def build(store: ArtifactStore, run: str, out: Path) -> Path:
    """Writes out/report.md and its PNGs; returns the markdown's path."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Run report: {run}", "", f"Store: `{store.url(store.path(run))}`", "",
             "| stage | status | wall time | peak RSS | resumed from | content key |", "|---|---|---|---|---|---|"]
    details: list[str] = []
    for stage in STAGES:
        status, manifest = stage_status(store, run, stage)
        if manifest is None:
            if status != "not run":
                lines.append(f"| {stage} | {status} | | | | |")
            continue
        seconds, rss = manifest["timings"]["seconds"], manifest["timings"].get("peak_rss_mb")
        resumed = manifest.get("resumed_from_step") or ""
        rss_text = f"{rss / 1024:.1f} GiB" if rss else ""  # manifests before peak RSS was recorded have none
        lines.append(f"| {stage} | {status} | {seconds:.0f} s | {rss_text} | {resumed} | `{manifest['key'][:12]}` |")
        details += [f"## {stage}", ""]
        details += [f"- `{name}`: {store.url(output_path(store, run, stage, name, rel))}" for name, rel in manifest["outputs"].items()]
        if manifest["metrics"]:
            details += ["", "| metric | value |", "|---|---|"]
            details += [f"| {k} | {_fmt(v)} |" for k, v in sorted(manifest["metrics"].items())]
        metrics_rel = manifest["outputs"].get("metrics")
        if metrics_rel and stage != "eval":
            series = curves(store.read_table(store.stage_path(run, stage, metrics_rel), METRICS_SCHEMA))
            if series:
                plot_curves(stage, series, out / f"{stage}.png")
                details += ["", f"![{stage} training curves]({stage}.png)"]
        if stage == "eval":
            store.fs.get_file(store.stage_path(run, "eval", "ratings.png"), str(out / "ratings.png"))
            board = store.fs.cat_file(store.stage_path(run, "eval", "leaderboard.md")).decode()
            details += ["", "### Leaderboard", "", board.strip(), "", "![Elo with 95% bootstrap intervals](ratings.png)"]
        details.append("")
    path = out / "report.md"
    path.write_text("\n".join(lines + [""] + details))
    return path
