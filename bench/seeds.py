"""Seeds of some stages over one finished run: copy the run's local store once per seed, rerun `--stages`
there with `run.seed=N` (plus `--set` overrides), let the verifier judge `--policies` on the held-out
prompts, and print each seed's held-out accuracies and paired differences against `--baseline`, then the
pooled difference (each prompt's correctness averaged over seeds) with its 95% bootstrap interval over
prompts. The stages not listed keep the finished run's artifacts, so only the listed ones vary.

Run (after the default run, `rlhf run`, has filled data/artifacts):
  .venv/bin/python bench/seeds.py --stages grpo --seeds 0 1 2 --policies sft dpo grpo
  .venv/bin/python bench/seeds.py --stages reward_model --seeds 0 --policies base sft --judge both \
      --metrics reward_model/eval_accuracy eval/reward_model/elo/base --set reward_model.lora.enabled=true
Prints one JSON line per seed and one for the pool. `--metrics` adds figures from the manifests of the
stages that ran (a name `<stage>/...` is read from that stage's manifest).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rlhf.core.loader import load_config  # noqa: E402
from rlhf.core.registry import NAMES  # noqa: E402
from rlhf.core.store import ArtifactStore  # noqa: E402
from rlhf.maths.bradley_terry import paired_accuracy_diff  # noqa: E402
from rlhf.pipeline.runner import execute_stage  # noqa: E402
from rlhf.core.tables import EVAL_SCHEMAS  # noqa: E402


def copy_run(src: Path, dst: Path, run: str, rerun: set[str]) -> None:
    """The run's folder without the stages that will run again (and without its lock), plus the store's own
    `_` entries (the shared reference cache); other runs in the store are not copied."""
    def skip(folder: str, names: list[str]) -> set[str]:
        if Path(folder) == src:
            return {n for n in names if n != run and not n.startswith("_")}
        if Path(folder) == src / run:
            return {n for n in names if n in rerun or n == "_lock.json"}
        return set()
    shutil.copytree(src, dst, ignore=skip)


def correct_by_policy(store: ArtifactStore, run: str, policies: list[str]) -> dict[str, np.ndarray]:
    """[P] 0/1 per held-out prompt for each policy (first sample, prompts in id order)."""
    rows = store.read_table(store.stage_path(run, "eval", "samples.parquet"), EVAL_SCHEMAS["samples"]).to_pylist()
    out = {}
    for policy in policies:
        mine = sorted((r["prompt_id"], r["correct"]) for r in rows if r["policy"] == policy and r["sample_index"] == 0)
        out[policy] = np.array([c for _, c in mine], float)
    return out


def diffs(correct: dict[str, np.ndarray], baseline: str) -> dict:
    res = {p: round(float(c.mean()), 4) for p, c in correct.items()}
    for p, c in correct.items():
        if p != baseline:
            res[f"{p}-{baseline}"] = [round(x, 4) for x in paired_accuracy_diff(c, correct[baseline])]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "pipeline.yaml"))
    ap.add_argument("--profile", default="default")
    ap.add_argument("--store", default=str(REPO / "data" / "artifacts"), help="the finished run's local store")
    ap.add_argument("--stages", nargs="+", required=True, choices=[n for n in NAMES if n != "eval"],
                    help="the stages to run again per seed (run in DAG order)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--policies", nargs="+", default=["sft", "grpo"])
    ap.add_argument("--baseline", default="sft")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides for every seed (key=value)")
    ap.add_argument("--judge", choices=["verifier", "reward_model", "both"], default="verifier",
                    help="eval's judge (the accuracies printed are the verifier's either way)")
    ap.add_argument("--metrics", nargs="*", default=[], help="manifest metrics to print, e.g. reward_model/eval_accuracy")
    ap.add_argument("--keep", help="keep each seed's store under this folder (default: a temporary one)")
    args = ap.parse_args()
    if args.baseline not in args.policies:
        ap.error(f"--baseline {args.baseline!r} must be one of --policies {args.policies}")
    stages = [s for s in NAMES if s in args.stages] + ["eval"]
    for name in args.metrics:
        if name.split("/")[0] not in stages:
            ap.error(f"--metrics {name!r}: must start with a stage that runs ({', '.join(stages)})")

    src = Path(args.store).resolve()
    run = load_config(args.config, args.profile, [f"storage.url={src}", *args.set]).run.name
    if not (src / run).is_dir():
        ap.error(f"--store {src}: no run {run!r} there (run `rlhf run` first)")
    root = Path(args.keep or tempfile.mkdtemp(prefix="rlhf-seeds-"))
    pooled = []
    try:
        for seed in args.seeds:
            dst = root / f"seed{seed}"
            shutil.rmtree(dst, ignore_errors=True)
            copy_run(src, dst, run, {*args.stages, "eval"})
            cfg = load_config(args.config, args.profile, [f"storage.url={dst}", f"run.seed={seed}", *args.set, f"eval.judge={args.judge}",
                                                          f"eval.policies=[{','.join(args.policies)}]"])
            manifests = {s: execute_stage(cfg, s) for s in stages}
            correct = correct_by_policy(ArtifactStore(cfg.storage), run, args.policies)
            pooled.append(correct)
            picked = {m: manifests[m.split("/")[0]]["metrics"].get(m) for m in args.metrics}
            times = {s: m["timings"]["seconds"] for s, m in manifests.items()}
            print(json.dumps({"seed": seed, **diffs(correct, args.baseline), **picked, "seconds": times}), flush=True)
    finally:  # a copy of the store per seed: gigabytes, so none is left behind unless asked for
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    mean = {p: np.mean([c[p] for c in pooled], axis=0) for p in args.policies}
    print(json.dumps({"pooled_seeds": args.seeds, **diffs(mean, args.baseline)}))


if __name__ == "__main__":
    main()
