"""Episodes, measured: base and a run's trained policies answer the same held-out prompts greedily, as
episodes with the run's environment (grpo.environment, or one given with --set) and as one answer without
it. Success: the task's verifier accepts the whole transcript (its last answer). 95% Wilson intervals per
rate, paired-bootstrap intervals for the differences that matter (each policy with the environment against
without it; the last policy against the first, and the first against base, with it).

    .venv/bin/rlhf run --profile tools --set storage.url=/tmp/tools-store
    .venv/bin/python bench/tool_episodes.py --profile tools --store /tmp/tools-store --prompts 128
    # the default run's policies with three attempts and feedback
    .venv/bin/python bench/tool_episodes.py --profile default --store S --prompts 512 --max-new-tokens 16 \
        --policies sft dpo grpo --set 'grpo.environment={name: feedback, max_turns: 3, max_tokens: 128}'
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="tools")
    ap.add_argument("--store", required=True)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=48, help="per policy turn (and for the one answer)")
    ap.add_argument("--policies", nargs="+", default=["sft", "grpo"], help="trained stages of the run, besides base")
    ap.add_argument("--set", action="append", default=[], help="a config override, as `rlhf run --set`")
    args = ap.parse_args(argv)

    from rlhf.core.loader import load_config
    from rlhf.core.models import load_causal_lm, load_tokenizer, resolve_model
    from rlhf.core.store import ArtifactStore
    from rlhf.data.sources import make_task
    from rlhf.engines.engine import HFEngine, SamplingParams
    from rlhf.envs.episodes import episode_stats, play
    from rlhf.maths.bradley_terry import paired_accuracy_diff, wilson_interval

    cfg = load_config(ROOT / "pipeline.yaml", args.profile, [f"storage.url={args.store}", *args.set])
    env, store, task = cfg.grpo.environment, ArtifactStore(cfg.storage), make_task(cfg.data)
    problems = task.eval[: args.prompts]
    params = SamplingParams(0.0, 1.0, args.max_new_tokens)
    paths = {"base": resolve_model(cfg.model)}
    for stage in args.policies:
        m = store.require_manifest(cfg.run.name, stage)
        paths[stage] = store.stage_path(cfg.run.name, stage, m["outputs"]["model"])
    correct, report = {}, {"prompts": len(problems), "environment": env.name, "max_turns": env.max_turns}
    for name, path in paths.items():
        model, tok = load_causal_lm(path, cfg.model), load_tokenizer(path)
        with torch.inference_mode():
            eps = play(HFEngine(model, tok), problems, params, env)
            plain = HFEngine(model, tok).generate([p.messages() for p in problems], params)
        for mode, gens in (("episodes", eps), ("single", plain)):
            ok = np.array([task.score(g.text, problems[g.prompt_index]) >= 1.0 for g in gens], float)
            correct[(name, mode)] = ok
            lo, hi = wilson_interval(int(ok.sum()), len(ok))
            report[f"{name}/{mode}"] = {"success": round(float(ok.mean()), 3), "ci": [round(lo, 3), round(hi, 3)],
                                        **({k: round(v, 3) for k, v in episode_stats(gens).items()} if mode == "episodes" else {})}
        report[f"{name}/example"] = eps[0].text[:200]
        print(json.dumps(report), flush=True)
    first, last = args.policies[0], args.policies[-1]
    pairs = [((p, "episodes"), (p, "single")) for p in ["base", *args.policies]]
    pairs += [((last, "episodes"), (first, "episodes")), ((first, "episodes"), ("base", "episodes"))]
    for a, b in pairs:
        mean, lo, hi = paired_accuracy_diff(correct[a], correct[b])
        report[f"{'/'.join(a)} - {'/'.join(b)}"] = [round(mean, 3), round(lo, 3), round(hi, 3)]
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
