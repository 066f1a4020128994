"""On-policy comparison data, shared by the preferences stage and DPO's later rounds: K sampled answers
per prompt, a judge's scores, and the pairs they give (rlhf.data.pairs.build_pairs) in PAIRS_SCHEMA rows.
"""

from __future__ import annotations

from rlhf.core.config import PreferencesConfig
from rlhf.data.pairs import build_pairs, contrast_pairs
from rlhf.data.tasks import Problem, assistant
from rlhf.data.sources import PromptSource
from rlhf.engines.engine import SamplingParams
from rlhf.train.rewards import function_scores, import_reward_function, load_reward_model, reward_model_scores


def make_judge(cfg: PreferencesConfig, task: PromptSource, dtype: str):
    """judge(problems, texts, token_ids) -> scores; and its name for the provenance column."""
    if cfg.judge == "function":
        fn = import_reward_function(cfg.reward_function)
        return (lambda problems, texts, ids: function_scores(fn, problems, texts, ids, cfg.reward_function)), f"function:{cfg.reward_function}"
    if cfg.judge == "reward_model":
        rm, tok = load_reward_model(cfg.reward_model_path, dtype)

        def judge(problems, texts, ids):
            return reward_model_scores(rm, tok, [p.messages() + [assistant(t)] for p, t in zip(problems, texts)])

        return judge, f"reward_model:{cfg.reward_model_path}"
    return (lambda problems, texts, ids: [task.score(t, p) for p, t in zip(problems, texts)]), "verifier"


def sample_and_judge(engine, problems: list[Problem], cfg: PreferencesConfig, judge, log_progress,
                     n: int | None = None) -> list[list]:
    """Per problem, its K (or `n`) generations with scores: [[(generation, score), ...], ...]."""
    params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, n or cfg.samples_per_prompt, cfg.seed)
    gens = engine.generate([p.messages() for p in problems], params, on_batch=log_progress)
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
        rows += [pair_row(problem, f"{c}:{r}", (c, group[c]), (r, group[r]), cfg, judge_name, policy, policy_key)
                 for c, r in chosen_rejected[: cfg.max_pairs_per_prompt]]
    return rows, ties


def pair_row(problem: Problem, suffix: str, chosen: tuple, rejected: tuple, cfg: PreferencesConfig,
             judge_name: str, policy: str, policy_key: str) -> dict:
    """One PAIRS_SCHEMA row; chosen and rejected are (sample index, (generation, score))."""
    (c, (c_gen, c_score)), (r, (r_gen, r_score)) = chosen, rejected
    return {
        "pair_id": f"{problem.id}:{suffix}", "prompt": problem.messages(),
        "chosen": [assistant(c_gen.text)], "rejected": [assistant(r_gen.text)],
        "prompt_id": problem.id, "chosen_index": c, "rejected_index": r,
        "chosen_score": float(c_score), "rejected_score": float(r_score), "judge": judge_name,
        "policy": policy, "policy_key": policy_key, "temperature": cfg.temperature, "top_p": cfg.top_p,
        "samples_per_prompt": cfg.samples_per_prompt,
    }


def contrast_rows(problems: list[Problem], policy_grouped: list[list], base_grouped: list[list],
                  cfg: PreferencesConfig, judge_name: str, policy_key: str) -> tuple[list[dict], int]:
    """PAIRS_SCHEMA rows of the policy's answers (chosen) against the base model's (rejected) on the
    same prompts (rlhf.data.pairs.contrast_pairs), and the base answers left unpaired."""
    rows, unpaired = [], 0
    for problem, group, base in zip(problems, policy_grouped, base_grouped):
        pairs, n_unpaired = contrast_pairs([s for _, s in group], [s for _, s in base])
        unpaired += n_unpaired
        rows += [pair_row(problem, f"{c}:base{r}", (c, group[c]), (r, base[r]), cfg, judge_name, "sft+base", policy_key)
                 for c, r in pairs]
    return rows, unpaired
