"""All CPU benchmarks in one command; writes bench/results/suite.json and suite.md (a markdown table).

Each benchmark runs in a fresh process of its own and prints one JSON line last; where a peer exists the
figure is a ratio from that one run (ours / peer, side by side on the same machine):
  dpo_cache       DPO epoch with the durable reference cache vs TRL DPOTrainer's per-step reference
  kto_cache       the same for KTO
  grpo_vs_trl     our GRPO loop vs TRL GRPOTrainer, same model, prompts and iterations
  ref_throughput  the reference pass (log-prob bookkeeping included) vs a plain forward of the same batches
  elo             Bradley-Terry fit + 1000 bootstrap rounds on 100k battles; DuckDB over 1M battle rows
  vllm_vs_hf      rollout tokens/s of the vLLM engine (own environment) vs transformers generate
  ray_launch      a 2-rank tiny SFT launched on a two-node local Ray cluster vs torchrun on this node
  ray_rl_actors   tiny GRPO on Ray: rollout engine and frozen scorers in the rank vs in actors of their own
  orchestration   the tiny profile through `rlhf run` (Prefect flow, temporary API): wall time minus the
                  sum of the stages' own seconds (manifests), and that share of the wall time
  default_run     (--full, about 15 min) the default profile end to end: wall time, per-stage seconds
                  and per-stage peak RSS (manifest timings: sampled peak of the process and its children)

    .venv/bin/python bench/suite.py [--full] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
SCRIPTS = {
    "dpo_cache": ["bench/dpo_cache.py", "--decompose"],
    "kto_cache": ["bench/kto_cache.py"],
    "grpo_vs_trl": ["bench/grpo_vs_trl.py"],
    "ref_throughput": ["bench/ref_throughput.py"],
    "elo": ["bench/elo.py"],
    "vllm_vs_hf": ["bench/vllm_vs_hf.py"],
    "ray_launch": ["bench/ray_launch.py"],
    "ray_rl_actors": ["bench/ray_launch.py", "--rl"],
}


def last_json(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def pipeline(profile: str) -> dict:
    """`rlhf run` of a profile into a fresh store: wall time, each stage's own seconds, and the rest."""
    sys.path.insert(0, str(ROOT))
    from rlhf.core.config import StorageConfig
    from rlhf.core.registry import NAMES as STAGES
    from rlhf.core.store import ArtifactStore

    with tempfile.TemporaryDirectory() as root:
        name = f"bench-{profile}"
        t0 = time.perf_counter()
        subprocess.run([str(Path(PY).parent / "rlhf"), "run", "--profile", profile, "--run-name", name,
                        "--set", f"storage.url={root}"], cwd=ROOT, check=True, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        store = ArtifactStore(StorageConfig(url=root))
        stages, rss = {}, {}
        for stage in STAGES:
            manifest = store.read_manifest(name, stage)
            if manifest:
                stages[stage] = round(manifest["timings"]["seconds"], 2)
                rss[stage] = manifest["timings"].get("peak_rss_mb")
    inside = sum(stages.values())
    return {"wall_s": round(wall, 2), "sum_stage_s": round(inside, 2), "overhead_s": round(wall - inside, 2),
            "overhead_share_of_wall": round((wall - inside) / wall, 3), "stage_seconds": stages,
            "stage_peak_rss_mb": rss}


def markdown(results: dict) -> str:
    lines = ["| benchmark | figures |", "|---|---|"]
    for name, figures in results.items():
        shown = ", ".join(f"{k} {v}" for k, v in figures.items() if not isinstance(v, dict))
        nested = "; ".join(f"{k}: {v}" for k, v in figures.items() if isinstance(v, dict))
        lines.append(f"| {name} | {shown}{'; ' + nested if nested else ''} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="also the default profile end to end (about 15 min)")
    ap.add_argument("--only", nargs="*", help="run only these benchmarks")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args()
    wanted = [*SCRIPTS, "orchestration", *(["default_run"] if a.full or (a.only and "default_run" in a.only) else [])]
    a.out.mkdir(parents=True, exist_ok=True)
    saved = a.out / "suite.json"
    # Each benchmark's latest figures: a partial run (--only) updates its rows and keeps the others.
    results: dict[str, dict] = json.loads(saved.read_text()) if saved.exists() else {}
    for name in wanted:
        if a.only and name not in a.only:
            continue
        t0 = time.perf_counter()
        if name in SCRIPTS:
            figures = last_json([PY, *SCRIPTS[name]])
        else:
            figures = pipeline("tiny" if name == "orchestration" else "default")
        results[name] = {"measured": time.strftime("%Y-%m-%d %H:%M"), **figures}
        print(f"{name}: {json.dumps(results[name])} ({time.perf_counter() - t0:.0f} s)", flush=True)
        saved.write_text(json.dumps(results, indent=1))  # after each: a later failure loses nothing
        (a.out / "suite.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
