"""Asynchronous rollouts against the synchronous loop, side by side: the GRPO stage of a completed run,
rerun in copies of its store with rollout.async unset and with each given max_lag, alternating, `--repeats`
times. Reports per variant: the stage's wall time, samples per second over the loop, the time the trainer
waited for samples, the reward curve and the held-out accuracy the stage reports.

    .venv/bin/rlhf run --set storage.url=/tmp/store        # the default profile, once
    .venv/bin/python bench/async_rollout.py --store /tmp/store --lags 1 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="a local store holding a completed run of --profile")
    ap.add_argument("--profile", default="default")
    ap.add_argument("--lags", type=int, nargs="+", default=[1])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--work", default="/tmp/async-bench", help="where the store copies go")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra overrides, key=value")
    ap.add_argument("--threads", type=int, nargs="*", default=[], help="also each max_lag with rollout.async.threads")
    ap.add_argument("--no-sync", action="store_true", help="leave out the synchronous loop")
    args = ap.parse_args(argv)

    from rlhf.core.loader import load_config
    from rlhf.core.store import ArtifactStore
    from rlhf.core.tables import METRICS_SCHEMA
    from rlhf.pipeline.runner import execute_stage

    source = Path(args.store)
    name = load_config(ROOT / "pipeline.yaml", args.profile, [f"storage.url={source}"]).run.name
    variants = ([] if args.no_sync else [("sync", [])]) + [(f"max_lag={n}", [f"rollout.async.max_lag={n}"]) for n in args.lags]
    variants += [(f"max_lag={n},threads={t}", [f"rollout.async.max_lag={n}", f"rollout.async.threads={t}"])
                 for n in args.lags for t in args.threads]
    report: dict[str, list] = {v: [] for v, _ in variants}
    for repeat in range(args.repeats):
        for variant, extra in variants:
            work = Path(args.work) / f"{variant}-{repeat}"
            shutil.rmtree(work, ignore_errors=True)
            # the upstream stages as they are; this stage and what follows it, not
            shutil.copytree(source, work, ignore=lambda d, names: [n for n in names if Path(d) == source / name
                                                                   and n in ("grpo", "eval", "_report", "_lock.json")])
            cfg = load_config(ROOT / "pipeline.yaml", args.profile, [f"storage.url={work}", *args.overrides, *extra])
            t0 = time.perf_counter()
            result = execute_stage(cfg, "grpo")
            wall = time.perf_counter() - t0
            store = ArtifactStore(cfg.storage)
            rows = store.read_table(store.stage_path(name, "grpo", "metrics.parquet"), METRICS_SCHEMA).to_pylist()
            series = lambda key: [r["value"] for r in sorted(rows, key=lambda r: r["step"]) if r["name"] == key]  # noqa: E731
            seconds = sum(series("seconds"))
            samples = cfg.grpo.iterations * cfg.grpo.rollouts_per_iteration()
            entry = {"stage_s": round(wall, 1), "loop_s": round(seconds, 1), "samples_per_s": round(samples / seconds, 2),
                     "wait_s": round(sum(series("sample_wait_s")), 1), "lag": series("rollout_lag"),
                     "reward": [round(x, 3) for x in series("reward_mean")],
                     "accuracy": result["metrics"].get("grpo/accuracy")}
            report[variant].append(entry)
            print(variant, repeat, json.dumps(entry), flush=True)
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
