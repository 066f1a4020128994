"""Evaluation: every listed policy answers the same held-out prompts; pairwise battles judged by the
task verifier and/or the reward model; Bradley-Terry Elo with 95% intervals from a bootstrap over prompts.

Judges: verifier (right beats wrong; both right or both wrong is a tie), reward model (higher score
wins; within `tie_margin` is a tie). Per policy: verifier accuracy, mean reward-model score, mean
response length, and mean log-ratio to the reference policy on the policy's own samples
(sum_t log pi(y_t) - log pi_ref(y_t): the k1 KL estimate, Schulman 2020; with greedy decoding it is
a divergence measure on the greedy outputs, not an unbiased KL).
Outputs (Parquet, explicit schemas): samples, battles, ratings, metrics, accuracy_diffs, run; plus
`leaderboard.md` and `ratings.png`. rlhf/ops/results.py exposes them to DuckDB across runs.
"""

from __future__ import annotations

import itertools
import json
from datetime import datetime, timezone

import numpy as np
import torch

from rlhf.core import codehash, fingerprint, progress
from rlhf.core.config import policy_kind
from rlhf.maths.bradley_terry import paired_accuracy_diff, rate
from rlhf.maths.style_control import rate_length_controlled
from rlhf.core.config import EvalConfig
from rlhf.engines.engine import HFEngine, SamplingParams, chat_ids
from rlhf.engines.logprobs import response_logps
from rlhf.core.models import inference_model, load_causal_lm, load_tokenizer, model_identity, resolve_model
from rlhf.engines import answers
from rlhf.envs.base import resolve
from rlhf.envs.episodes import episode_stats, play
from rlhf.train.rewards import load_reward_model, reward_model_scores
from rlhf.core.stage import StageContext, StageResult
from rlhf.data.tasks import assistant
from rlhf.data.sources import make_task
from rlhf.train.training import fetch_model


def policy_path(ctx: StageContext, policy: str) -> str:
    """A folder or hub id that from_pretrained loads: the base model, any model:<id or folder>, or a stage's
    `model/` (this run's, or '<run>/<stage>' another run's)."""
    if policy == "base":
        return resolve_model(ctx.cfg.model)
    if policy_kind(policy) == "model":
        return policy.removeprefix("model:")
    return fetch_model(ctx, ctx.inputs.named(policy))


def policy_identity(ctx: StageContext, policy: str) -> tuple[str, dict]:
    """The policy's name across runs (the leaderboard's) and what identifies its weights: a stage's content
    key, or a model's fingerprint."""
    if policy == "base":
        return f"base:{ctx.cfg.model.name}", {**model_identity(ctx.cfg.model), **fingerprint.model(ctx.cfg.model.name)}
    if policy_kind(policy) == "model":
        name = policy.removeprefix("model:")
        return policy, {"name": name, "dtype": inference_model(ctx.cfg.model).dtype, **fingerprint.model(name)}
    label = policy if policy_kind(policy) == "run" else f"{ctx.cfg.run.name}/{policy}"
    return label, {"key": ctx.inputs.named(policy).key}


def generation_code(env=None) -> dict[str, str]:
    """The code answers depend on (the engine, the prompts and their verifier; episodes: the episode loop and
    a built-in environment's module, whose class it names by string) with its numeric packages. A user's
    class is keyed by environment_identity."""
    envs = ()
    if env is not None:
        module = resolve(env.name).partition(":")[0]
        envs = ("rlhf/envs/episodes.py", *((module.replace(".", "/") + ".py",) if module.startswith("rlhf.") else ()))
    files = codehash.closure(("rlhf/engines/engine.py", "rlhf/data/sources.py", *envs))
    return {"files": codehash.digests(files), "packages": fingerprint.packages(codehash.third_party(files))}


def environment_identity(env) -> dict | None:
    """What identifies episodes' environment in the answers cache: its settings and, for a class of the
    user's ('module:Class'), the source of its module; None for single answers."""
    if env is None:
        return None
    return {"settings": env.model_dump(mode="json"), "source": fingerprint.function(env.name) if ":" in env.name else {}}


def sample_policies(cfg: EvalConfig, ctx: StageContext, task, problems) -> tuple[dict[str, list], dict[str, str], dict]:
    """Each policy's answers: from the store's answers cache when it holds them, else generated. Returns the
    answers, the cache keys of those generated here (stored once scored), and the generated/reused counts."""
    prompts = [p.messages() for p in problems]
    params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, cfg.samples_per_prompt, cfg.seed)
    code, environment = generation_code(cfg.environment), environment_identity(cfg.environment)
    verifier = "none" if task.open_ended else (ctx.cfg.data.verifier if ctx.cfg.data.prompts_path else ctx.cfg.data.task)
    out, new, counts = {}, {}, {"generated": 0, "reused": 0}
    for k, policy in enumerate(cfg.policies):
        key = answers.answers_key(policy_identity(ctx, policy)[1], prompts, params, cfg.batch_size, verifier,
                                  code, inference_model(ctx.cfg.model).dtype, environment)
        if (cached := answers.read(ctx.store, key)) is not None:
            out[policy] = cached[0]
            counts["reused"] += len(out[policy])
            ctx.log.info("eval: %s: %d answers reused (%s)", policy, len(out[policy]), key[:12])
            continue
        path = policy_path(ctx, policy)
        tok, model = load_tokenizer(path), load_causal_lm(path, inference_model(ctx.cfg.model))

        def log(done, total, p=policy, k=k):  # generation is most of the stage: its share drives progress
            ctx.log.info("eval: %s generated %d/%d", p, done, total)
            progress.report(ctx.stage, k + done / total, len(cfg.policies))

        engine = HFEngine(model, tok, cfg.batch_size)
        if cfg.environment is not None:
            out[policy] = play(engine, problems, params, cfg.environment)
            progress.report(ctx.stage, k + 1, len(cfg.policies))
        else:
            out[policy] = engine.generate(prompts, params, on_batch=log)
        new[policy] = key
        counts["generated"] += len(out[policy])
        del model
    return out, new, counts


def keep_answers(ctx: StageContext, cfg: EvalConfig, problems, gens: dict, scores, new: dict[str, str]) -> None:
    """Writes the answers generated here into the store's cache, with their verifier scores, and the prompts'
    text once per prompt set (for a judge that reads the question: `rlhf leaderboard --judge-model`)."""
    prompts = [p.messages() for p in problems]
    answers.keep_prompts(ctx.store, prompts)
    for policy, key in new.items():
        label = policy_identity(ctx, policy)[0]
        values = [float(v) for v in scores[policy]] if scores else [None] * len(gens[policy])
        answers.write(ctx.store, key, gens[policy], values, [p.id for p in problems], {
            "policy": label, "run": ctx.cfg.run.name, "prompt_set": answers.prompt_set(prompts),
            "params": {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens,
                       "n": cfg.samples_per_prompt, "seed": cfg.seed,
                       # episodes are rated only against episodes of the same environment (the leaderboard's groups)
                       **({"environment": cfg.environment.model_dump(mode="json")} if cfg.environment else {})},
            "verified": scores is not None})


def distinct(keys: list) -> tuple[list[int], list[int]]:
    """The first row of each distinct key, and for every row the position of its key in that list.
    Policies often give the same greedy answer to a prompt (SFT, DPO and GRPO agree on most): a frozen
    scorer sees each (prompt, answer) once."""
    position: dict = {}
    rows, where = [], []
    for i, k in enumerate(keys):
        if k not in position:
            position[k] = len(rows)
            rows.append(i)
        where.append(position[k])
    return rows, where


def score_distinct(gens: dict[str, list], policies: list[str], key, score) -> dict[str, list]:
    """`score(samples) -> one value per sample` run once per distinct `key(sample)` over the policies'
    samples, each value mapped back to every sample with that key, per policy."""
    samples = [g for p in policies for g in gens[p]]
    rows, where = distinct([key(g) for g in samples])
    values = score([samples[i] for i in rows])
    flat = iter(values[w] for w in where)
    return {p: [next(flat) for _ in gens[p]] for p in policies}


def log_ratio_to_reference(ctx: StageContext, cfg: EvalConfig, prompts, gens: dict[str, list]) -> dict[str, list[float]]:
    """Per-sample sum_t (log pi - log pi_ref) on each policy's own samples, ref = SFT (or base); the
    reference's own samples are 0 by definition (not scored again: a quarter of this pass in the default)."""
    ref = ctx.inputs.reference.stage if ctx.inputs.reference else "base"
    out = {ref: [0.0] * len(gens[ref])} if ref in gens else {}
    scored = [p for p in gens if p not in out]
    if not scored:
        return out
    path = policy_path(ctx, ref)
    tok, model = load_tokenizer(path), load_causal_lm(path, inference_model(ctx.cfg.model))
    prompt_ids = [chat_ids(tok, p) for p in prompts]
    ref_lp = score_distinct(gens, scored, lambda g: (g.prompt_index, tuple(g.token_ids)), lambda samples: response_logps(
        model, [list(prompt_ids[g.prompt_index]) for g in samples], [g.token_ids for g in samples], tok.pad_token_id,
        cfg.batch_size))
    # an episode's environment tokens are no one's choice: both sums skip them (their logprobs are 0)
    out.update({p: [float(sum(g.logprobs) - sum(x for x, m in zip(r, g.mask or [1] * len(r)) if m))
                    for g, r in zip(gens[p], ref_lp[p])] for p in scored})
    return out


def rm_rewards(ctx: StageContext, cfg: EvalConfig, prompts, gens: dict[str, list]) -> dict[str, list[float]] | None:
    if ctx.inputs.reward_model is None:
        return None
    model, tok = load_reward_model(fetch_model(ctx, ctx.inputs.reward_model), inference_model(ctx.cfg.model).dtype)
    return score_distinct(gens, list(gens), lambda g: (g.prompt_index, g.text), lambda samples: reward_model_scores(
        model, tok, [prompts[g.prompt_index] + [assistant(g.text)] for g in samples], cfg.batch_size))


def battles(cfg: EvalConfig, correct: dict[str, np.ndarray], rewards: dict[str, np.ndarray] | None, ids: list[tuple],
            tokens: dict[str, list[int]]) -> list[dict]:
    judges = {"verifier": ["verifier"], "reward_model": ["reward_model"], "both": ["verifier", "reward_model"]}[cfg.judge]
    rows = []
    for judge in judges:
        for a, b in itertools.combinations(cfg.policies, 2):
            if judge == "verifier":
                sa = np.where(correct[a] == correct[b], 0.5, (correct[a] > correct[b]).astype(float))
            else:
                d = rewards[a] - rewards[b]
                sa = np.where(np.abs(d) <= cfg.tie_margin, 0.5, (d > 0).astype(float))
            rows += [{"prompt_id": pid, "sample_index": s, "judge": judge, "policy_a": a, "policy_b": b, "score_a": float(x),
                      "tokens_a": ta, "tokens_b": tb} for (pid, s), x, ta, tb in zip(ids, sa, tokens[a], tokens[b])]
    return rows


def run(cfg: EvalConfig, ctx: StageContext) -> StageResult:
    run_name = ctx.cfg.run.name
    task = make_task(ctx.cfg.data)
    problems = task.eval[: cfg.prompts]
    prompts = [p.messages() for p in problems]
    with torch.inference_mode():
        gens, new, counts = sample_policies(cfg, ctx, task, problems)
        kl = log_ratio_to_reference(ctx, cfg, prompts, gens)
        rewards = rm_rewards(ctx, cfg, prompts, gens)
    ids = [(problems[g.prompt_index].id, g.sample_index) for g in gens[cfg.policies[0]]]
    # open-ended prompts (no gold answers) have no verifier score: the reward model is the only judge
    scores = None if task.open_ended else {
        p: np.array([task.score(g.text, problems[g.prompt_index]) for g in gens[p]]) for p in cfg.policies}
    correct = {p: (s >= 1.0).astype(float) for p, s in scores.items()} if scores else None
    rm = {p: np.array(v) for p, v in rewards.items()} if rewards else None
    keep_answers(ctx, cfg, problems, gens, scores, new)

    samples = [
        {"run": run_name, "policy": p, "prompt_id": problems[g.prompt_index].id, "sample_index": g.sample_index,
         "prompt": problems[g.prompt_index].question, "response": g.text,
         "verifier_score": float(scores[p][i]) if scores else None, "correct": bool(correct[p][i]) if correct else None,
         "rm_reward": float(rm[p][i]) if rm else None,
         "response_tokens": len(g.token_ids), "log_ratio_to_ref": kl[p][i], "finish_reason": g.finish_reason}
        for p in cfg.policies for i, g in enumerate(gens[p])
    ]
    tokens = {p: [len(g.token_ids) for g in gens[p]] for p in cfg.policies}
    battle_rows = [{"run": run_name, **r} for r in battles(cfg, correct, rm, ids, tokens)]
    index = {p: i for i, p in enumerate(cfg.policies)}
    rating_rows, metrics = [], {}
    for judge in sorted({r["judge"] for r in battle_rows}):
        rs = [r for r in battle_rows if r["judge"] == judge]
        a = np.array([index[r["policy_a"]] for r in rs])
        b = np.array([index[r["policy_b"]] for r in rs])
        # The bootstrap resamples prompts: all battles on one prompt share its difficulty.
        score, clusters = np.array([x["score_a"] for x in rs]), np.array([x["prompt_id"] for x in rs])
        r = rate(a, b, score, cfg.policies, cfg.anchor, cfg.bootstrap_rounds, cfg.seed, clusters=clusters)
        lc = rate_length_controlled(a, b, score, np.array([x["tokens_a"] for x in rs]), np.array([x["tokens_b"] for x in rs]),
                                    cfg.policies, cfg.anchor, cfg.bootstrap_rounds, cfg.seed, clusters=clusters)
        for i, p in enumerate(cfg.policies):
            rating_rows.append({"run": run_name, "judge": judge, "policy": p, "elo": float(r.elo[i]),
                                "ci_low": float(r.ci_low[i]), "ci_high": float(r.ci_high[i]),
                                "battles": int(r.battles[i].sum()),
                                "accuracy": float(correct[p].mean()) if correct else None,
                                "lc_elo": float(lc.elo[i]), "lc_ci_low": float(lc.ci_low[i]), "lc_ci_high": float(lc.ci_high[i]),
                                "length_coef": lc.gamma, "length_coef_ci_low": lc.gamma_ci[0],
                                "length_coef_ci_high": lc.gamma_ci[1]})
            metrics[f"eval/{judge}/elo/{p}"] = float(r.elo[i])
            metrics[f"eval/{judge}/lc_elo/{p}"] = float(lc.elo[i])
        metrics[f"eval/{judge}/ci95_width_max"] = float((r.ci_high - r.ci_low).max())
        metrics[f"eval/{judge}/length_coef"] = lc.gamma
    metric_rows = []
    for p in cfg.policies:
        values = {**({"accuracy": correct[p].mean()} if correct else {}),
                  "mean_response_tokens": np.mean([len(g.token_ids) for g in gens[p]]), "mean_log_ratio_to_ref": np.mean(kl[p])}
        if rm:
            values["mean_rm_reward"] = rm[p].mean()
        if cfg.environment is not None:
            values.update(episode_stats(gens[p]))
        metric_rows += [{"run": run_name, "policy": p, "name": k, "value": float(v)} for k, v in values.items()]
        metrics.update({f"eval/{k}/{p}": float(v) for k, v in values.items()})
    diffs = []
    for a, b in itertools.combinations(cfg.policies, 2) if correct else ():
        mean, lo, hi = paired_accuracy_diff(correct[a], correct[b], cfg.bootstrap_rounds, cfg.seed)
        diffs.append({"run": run_name, "policy_a": a, "policy_b": b, "accuracy_diff": mean, "ci_low": lo, "ci_high": hi})
    run_row = [{"run": run_name, "profile": ctx.cfg.profile, "model": ctx.cfg.model.name,
                "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "stage_keys": json.dumps(ctx.inputs.keys()),
                "config": json.dumps(ctx.cfg.model_dump(mode="json"))}]

    tables = {"samples": samples, "battles": battle_rows, "ratings": rating_rows, "metrics": metric_rows,
              "accuracy_diffs": diffs, "run": run_row}
    outputs = {}
    for name, rows in tables.items():
        outputs[name] = ctx.write_output(name, rows)
    outputs["leaderboard"] = write_leaderboard(ctx, rating_rows)
    outputs["chart"] = write_chart(ctx, rating_rows)
    ctx.log.info("eval:\n%s", leaderboard_markdown(rating_rows))
    metrics.update({f"eval/answers_{k}": float(v) for k, v in counts.items()})
    return StageResult(outputs=outputs, rows={**{k: len(v) for k, v in tables.items()},
                                              **{f"answers_{k}": v for k, v in counts.items()}}, metrics=metrics)


def leaderboard_markdown(ratings: list[dict]) -> str:
    lines = ["| judge | policy | Elo | 95% CI | length-controlled Elo | 95% CI | accuracy | battles |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(ratings, key=lambda r: (r["judge"], -r["elo"])):
        accuracy = "-" if r["accuracy"] is None else f"{r['accuracy']:.3f}"
        lines.append(f"| {r['judge']} | {r['policy']} | {r['elo']:.0f} | [{r['ci_low']:.0f}, {r['ci_high']:.0f}] "
                     f"| {r['lc_elo']:.0f} | [{r['lc_ci_low']:.0f}, {r['lc_ci_high']:.0f}] | {accuracy} | {r['battles']} |")
    for judge in sorted({r["judge"] for r in ratings}):
        r = next(x for x in ratings if x["judge"] == judge)
        lines.append(f"\n{judge} judge's length coefficient: {r['length_coef']:+.2f} [{r['length_coef_ci_low']:+.2f}, "
                     f"{r['length_coef_ci_high']:+.2f}] (log-odds per unit of normalised length difference; > 0: prefers longer)")
    return "\n".join(lines)


def write_leaderboard(ctx: StageContext, ratings: list[dict]) -> str:
    ctx.store.write_bytes(ctx.path("leaderboard.md"), leaderboard_markdown(ratings).encode())
    return "leaderboard.md"


def write_chart(ctx: StageContext, ratings: list[dict]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    judges = sorted({r["judge"] for r in ratings})
    fig, axes = plt.subplots(1, len(judges), figsize=(5 * len(judges), 3.2), squeeze=False)
    for ax, judge in zip(axes[0], judges):
        rs = sorted((r for r in ratings if r["judge"] == judge), key=lambda r: r["elo"])
        y = np.arange(len(rs))
        err = np.array([[r["elo"] - r["ci_low"] for r in rs], [r["ci_high"] - r["elo"] for r in rs]])
        ax.errorbar([r["elo"] for r in rs], y, xerr=err, fmt="o", capsize=4)
        ax.set_yticks(y, [r["policy"] for r in rs])
        ax.set_xlabel("Elo (95% bootstrap CI)")
        ax.set_title(f"judge: {judge}")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    local = ctx.workdir / "ratings.png"
    local.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(local, dpi=100)
    plt.close(fig)
    ctx.store.put_file(local, ctx.path("ratings.png"))
    return "ratings.png"
