"""Ray launch overhead vs torchrun: the tiny profile's SFT on 2 ranks, launched by torchrun on this node
and by the Ray launcher on a two-node local cluster (ray.cluster_utils.Cluster, 1 CPU per node),
alternately, each into a fresh store. Prints one JSON line: wall seconds per launcher (median of
--repeats), the ratio Ray / torchrun, and the stage's own training seconds for reference.

With --rl: the tiny profile's GRPO (with a KL term, so a reference model scores) on one Ray rank, its
engine and scorers colocated in the rank vs each in an actor of its own (launch.ray.engine / scorers:
own) on a three-node cluster: what the weight sync and the scoring round trips cost per stage.

    .venv/bin/python bench/ray_launch.py [--repeats 2] [--rl]
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
RAY_RL = ["grpo.launch.backend=ray", "grpo.launch.ray.strategy=STRICT_SPREAD"]
RL = {"common": ["grpo.init_from=sft"] + [f"{s}.enabled={'true' if s == 'grpo' else 'false'}" for s in
                 ("sft", "preferences", "reward_model", "ref_logprobs", "dpo", "kto", "ppo", "grpo", "rollout", "eval")]
      + ["grpo.iterations=4", "grpo.prompts_per_iteration=4", "grpo.group_size=4", "grpo.minibatch_size=16",
         "grpo.beta=0.1", "grpo.eval_prompts=0", "rollout.max_new_tokens=16"],
      "launchers": {"colocated": RAY_RL, "actors": [*RAY_RL, "grpo.launch.ray.engine=own", "grpo.launch.ray.scorers=own"]}}


def once(stage: str, common: list[str], extra: list[str]) -> float:
    from rlhf.core.loader import load_config
    from rlhf.pipeline.runner import execute_stage

    with tempfile.TemporaryDirectory() as root:
        cfg = load_config(ROOT / "pipeline.yaml", "tiny", [f"storage.url={root}", *common, *extra])
        t0 = time.perf_counter()
        execute_stage(cfg, stage)
        return time.perf_counter() - t0


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__)
    a.add_argument("--repeats", type=int, default=2)
    a.add_argument("--rl", action="store_true", help="GRPO: engine and scorers colocated vs in actors of their own")
    args = a.parse_args()
    from ray.cluster_utils import Cluster

    stage, common, launchers = ("grpo", RL["common"], RL["launchers"]) if args.rl else ("sft", COMMON, LAUNCHERS)
    os.environ["RAY_worker_niceness"] = "0"  # dedicated nodes (Ray's default, 15, yields to any other work)
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2 if args.rl else 1):  # the rank, and (--rl) the engine's and the scorers' bundles
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    os.environ["RAY_ADDRESS"] = cluster.address
    start = time.perf_counter() - t0
    walls: dict[str, list[float]] = {k: [] for k in launchers}
    try:
        once(stage, common, [])  # warm caches (the converted tiny model, imports) before timing either launcher
        for _ in range(args.repeats):
            for name, extra in launchers.items():
                walls[name].append(once(stage, common, extra))
    finally:
        cluster.shutdown()
    med = {k: statistics.median(v) for k, v in walls.items()}
    base, other = list(launchers)
    print(json.dumps({f"{base}_s": round(med[base], 2), f"{other}_s": round(med[other], 2),
                      f"{other}_over_{base}": round(med[other] / med[base], 3), "cluster_start_s": round(start, 2),
                      "runs": {k: [round(x, 2) for x in v] for k, v in walls.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
