"""On-policy comparison data, shared by the preferences stage and DPO's later rounds: K sampled answers
per prompt, a judge's scores, and the pairs they give (rlhf.data.pairs.build_pairs) in PAIRS_SCHEMA rows.
"""

from __future__ import annotations

from rlhf.core.config import PreferencesConfig
from rlhf.core.models import load_tokenizer, torch_dtype
from rlhf.data.pairs import build_pairs
from rlhf.data.tasks import Problem, Task, assistant, user
from rlhf.engines.engine import SamplingParams
from rlhf.train.rewards import function_scores, import_reward_function, reward_model_scores


def make_judge(cfg: PreferencesConfig, task: Task, dtype: str):
    """judge(problems, texts, token_ids) -> scores; and its name for the provenance column."""
    if cfg.judge == "function":
        fn = import_reward_function(cfg.reward_function)
        return (lambda problems, texts, ids: function_scores(fn, problems, texts, ids)), f"function:{cfg.reward_function}"
    if cfg.judge == "reward_model":
        from transformers import AutoModelForSequenceClassification

        rm = AutoModelForSequenceClassification.from_pretrained(cfg.reward_model_path, dtype=torch_dtype(dtype))
        tok = load_tokenizer(cfg.reward_model_path)

        def judge(problems, texts, ids):
            return reward_model_scores(rm, tok, [[user(p.question), assistant(t)] for p, t in zip(problems, texts)])

        return judge, f"reward_model:{cfg.reward_model_path}"
    return (lambda problems, texts, ids: [task.score(t, p) for p, t in zip(problems, texts)]), "verifier"


def sample_and_judge(engine, problems: list[Problem], cfg: PreferencesConfig, judge, log_progress) -> list[list]:
    """Per problem, its K generations with scores: [[(generation, score), ...], ...]."""
    params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, cfg.samples_per_prompt, cfg.seed)
    gens = engine.generate([[user(p.question)] for p in problems], params, on_batch=log_progress)
    scores = judge([problems[g.prompt_index] for g in gens], [g.text for g in gens], [g.token_ids for g in gens])
    grouped: list[list] = [[] for _ in problems]
    for g, s in zip(gens, scores):
        grouped[g.prompt_index].append((g, s))
    return [sorted(group, key=lambda gs: gs[0].sample_index) for group in grouped]


def pair_rows(problems: list[Problem], grouped: list[list], cfg: PreferencesConfig, judge_name: str,
              policy: str, policy_key: str) -> tuple[list[dict], int]:
    """PAIRS_SCHEMA rows (at most cfg.max_pairs_per_prompt per prompt) and the ties dropped; `policy` and
    `policy_key` name whose samples they are."""
    rows, ties = [], 0
    for problem, group in zip(problems, grouped):
        chosen_rejected, n_ties = build_pairs([s for _, s in group], cfg.pairing)
        ties += n_ties
        for c, r in chosen_rejected[: cfg.max_pairs_per_prompt]:
            rows.append({
                "pair_id": f"{problem.id}:{c}:{r}", "prompt": [user(problem.question)],
                "chosen": [assistant(group[c][0].text)], "rejected": [assistant(group[r][0].text)],
                "prompt_id": problem.id, "chosen_index": c, "rejected_index": r,
                "chosen_score": float(group[c][1]), "rejected_score": float(group[r][1]), "judge": judge_name,
                "policy": policy, "policy_key": policy_key, "temperature": cfg.temperature, "top_p": cfg.top_p,
                "samples_per_prompt": cfg.samples_per_prompt,
            })
    return rows, ties
