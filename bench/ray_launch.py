"""Ray launch overhead vs torchrun: the tiny profile's SFT on 2 ranks, launched by torchrun on this node
and by the Ray launcher on a two-node local cluster (ray.cluster_utils.Cluster, 1 CPU per node),
alternately, each into a fresh store. Prints one JSON line: wall seconds per launcher (median of
--repeats), the ratio Ray / torchrun, and the stage's own training seconds for reference.

    .venv/bin/python bench/ray_launch.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
COMMON = ["sft.enabled=true", "sft.per_device_batch_size=4", "sft.max_steps=8", "sft.save_steps=4", "sft.eval_prompts=2",
          "sft.launch.processes=2"] + [f"{s}.enabled=false" for s in
                                       ("preferences", "reward_model", "ref_logprobs", "dpo", "kto", "ppo", "grpo", "rollout", "eval")]
LAUNCHERS = {"torchrun": [], "ray": ["sft.launch.backend=ray", "sft.launch.ray.strategy=STRICT_SPREAD"]}


def once(extra: list[str]) -> float:
    from rlhf.core.loader import load_config
    from rlhf.pipeline.runner import execute_stage

    with tempfile.TemporaryDirectory() as root:
        cfg = load_config(ROOT / "pipeline.yaml", "tiny", [f"storage.url={root}", *COMMON, *extra])
        t0 = time.perf_counter()
        execute_stage(cfg, "sft")
        return time.perf_counter() - t0


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__)
    a.add_argument("--repeats", type=int, default=2)
    args = a.parse_args()
    from ray.cluster_utils import Cluster

    os.environ["RAY_worker_niceness"] = "0"  # dedicated nodes (Ray's default, 15, yields to any other work)
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    os.environ["RAY_ADDRESS"] = cluster.address
    start = time.perf_counter() - t0
    walls: dict[str, list[float]] = {k: [] for k in LAUNCHERS}
    try:
        once([])  # warm caches (the converted tiny model, imports) before timing either launcher
        for _ in range(args.repeats):
            for name, extra in LAUNCHERS.items():
                walls[name].append(once(extra))
    finally:
        cluster.shutdown()
    med = {k: statistics.median(v) for k, v in walls.items()}
    print(json.dumps({"torchrun_s": round(med["torchrun"], 2), "ray_s": round(med["ray"], 2),
                      "ray_over_torchrun": round(med["ray"] / med["torchrun"], 3), "cluster_start_s": round(start, 2),
                      "runs": {k: [round(x, 2) for x in v] for k, v in walls.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
