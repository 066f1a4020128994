"""Our GRPO iteration vs TRL GRPOTrainer: same model, prompts, G, lengths, beta and update count.

Both: 8 chain_sum prompts x G=4 per iteration, 16 new tokens at temperature 1.0, beta 0.04 (a
reference model is loaded), one optimizer step per iteration, verifier reward, `--iterations` iterations.
Each variant runs in its own process; reported: seconds per iteration (model loading excluded) and peak
RSS. Ours also writes its experience Parquet and checkpoints the last iteration (it does that work; TRL
does not), so the comparison is conservative for us. `ours_rollout_logps` also takes logp_old from the
sampler (grpo.logp_old: rollout), as TRL does when each batch gets one update.
Run: .venv/bin/python bench/grpo_vs_trl.py [--model smollm2-135m-instruct|tiny] [--iterations 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from side_by_side import run_variants  # noqa: E402  (bench/ is sys.path[0] when run as a script)


def ours(model: str, iterations: int, logp_old: str = "recompute") -> dict:
    from rlhf.core.registry import NAMES as STAGES
    from rlhf.core.loader import load_config
    from rlhf.pipeline.runner import execute_stage

    with tempfile.TemporaryDirectory() as store:
        # Like for like with TRL: its prompts (the training problems), every group trained on.
        overrides = [f"storage.url={store}", f"model.name={model}", "run.name=bench", f"grpo.logp_old={logp_old}",
                     "data.rl_size=0", "grpo.skip_uniform_groups=false",
                     "grpo.lora.enabled=false",  # full weights, as the TRL side trains
                     "grpo.init_from=sft"]  # from the model itself (no DPO stage here), as TRL starts
        overrides += [f"{s}.enabled=false" for s in STAGES if s != "grpo"]
        overrides += ["grpo.enabled=true", f"grpo.iterations={iterations}", "grpo.prompts_per_iteration=8", "grpo.group_size=4",
                      "grpo.minibatch_size=32", "grpo.epochs=1", "grpo.beta=0.04", "grpo.eval_prompts=0",
                      f"grpo.save_every={iterations}", "rollout.max_new_tokens=16", "rollout.temperature=1.0", "rollout.batch_size=32"]
        m = execute_stage(load_config(ROOT / "pipeline.yaml", "default", overrides), "grpo")
    return {"seconds_per_iteration_last": m["metrics"]["grpo/seconds"], "stage_seconds": m["timings"]["seconds"]}


def trl(model: str, iterations: int) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf.core.config import DataConfig, ModelConfig
    from rlhf.core.models import load_causal_lm, load_tokenizer, resolve_model
    from rlhf.data.tasks import Task

    mcfg = ModelConfig(name=model)
    path = resolve_model(mcfg)
    task = Task(DataConfig())
    by_question = {p.question: p for p in task.train}
    rows = [{"prompt": [{"role": "user", "content": p.question}]} for p in task.train]

    def verifier(prompts, completions, **kw):
        return [task.score(c[-1]["content"], by_question[p[-1]["content"]]) for p, c in zip(prompts, completions)]

    class Timer(TrainerCallback):
        def __init__(self):
            self.marks = []

        def on_step_end(self, args, state, control, **kw):
            self.marks.append(time.perf_counter())

    timer = Timer()
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=32, num_generations=4, max_completion_length=16,
                          temperature=1.0, beta=0.04, max_steps=iterations, learning_rate=5e-6, report_to=[], use_cpu=True,
                          bf16=False, activation_checkpointing=False, save_strategy="no", logging_steps=1000, seed=0,
                          disable_tqdm=True)
        trainer = GRPOTrainer(model=load_causal_lm(path, mcfg), args=args, reward_funcs=verifier,
                              train_dataset=Dataset.from_list(rows), processing_class=load_tokenizer(path), callbacks=[timer])
        t0 = time.perf_counter()
        trainer.train()
    marks = [t0, *timer.marks]
    return {"seconds_per_iteration_last": marks[-1] - marks[-2], "stage_seconds": marks[-1] - t0}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--variant", choices=["ours", "ours_rollout_logps", "trl"])
    a = p.parse_args()
    if a.variant:
        out = {"ours": ours, "trl": trl, "ours_rollout_logps": lambda m, i: ours(m, i, "rollout")}[a.variant](a.model, a.iterations)
        out.update(variant=a.variant, model=a.model, iterations=a.iterations,
                   peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        print(json.dumps(out))
        return
    res = run_variants(__file__, ["--model", a.model, "--iterations", str(a.iterations)], ("ours", "ours_rollout_logps", "trl"))
    per_it = {k: v["seconds_per_iteration_last"] for k, v in res.items()}
    print(json.dumps({
        "time_per_iteration_ratio_ours_over_trl": round(per_it["ours"] / per_it["trl"], 3),
        # TRL takes its logp_old from the same pass when each batch gets one update: the like-for-like figure
        "time_per_iteration_ratio_ours_rollout_logps_over_trl": round(per_it["ours_rollout_logps"] / per_it["trl"], 3),
        "peak_rss_ratio_ours_over_trl": round(res["ours"]["peak_rss_mb"] / res["trl"]["peak_rss_mb"], 3),
    }))


if __name__ == "__main__":
    main()
