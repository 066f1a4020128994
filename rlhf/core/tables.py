"""Every Parquet table the pipeline writes, with the columns it has: one module, so that a stage's
declared outputs (rlhf/core/registry.py), the code that writes them, the stages that read them and the DuckDB
views of `rlhf query` all use the same schema. The store refuses a table whose schema differs (write and read).
"""

from __future__ import annotations

import pyarrow as pa

S, F, I, B = pa.string(), pa.float64(), pa.int64(), pa.bool_()


def _schema(*fields) -> pa.Schema:
    return pa.schema([pa.field(name, typ) for name, typ in fields])


# ---- written by every training stage: its curves ------------------------------------------------------
# Long format so DuckDB can pivot any metric: one row per (step, metric).
METRICS_SCHEMA = pa.schema(
    [
        pa.field("stage", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("epoch", pa.float64()),
        pa.field("name", pa.string(), nullable=False),
        pa.field("value", pa.float64()),
    ]
)

# ---- preferences ---------------------------------------------------------------------------------------
_MESSAGES = pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())]))
# preferences: pairs, eval_pairs, contrast_pairs (DPO's later rounds write the same). TRL's conversational preference format plus provenance.
PAIRS_SCHEMA = pa.schema([
    pa.field("pair_id", pa.string(), nullable=False),  # "<prompt id>:<chosen index>:<rejected index>"
    pa.field("prompt", _MESSAGES),
    pa.field("chosen", _MESSAGES),
    pa.field("rejected", _MESSAGES),
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("chosen_index", pa.int64()),  # sample index of the chosen answer among the K
    pa.field("rejected_index", pa.int64()),
    pa.field("chosen_score", pa.float64()),  # the judge's scores
    pa.field("rejected_score", pa.float64()),
    pa.field("judge", pa.string()),  # verifier | function:<module:function> | reward_model:<path>
    # whose samples: base | sft | dpo-round-<r> (DPO's later rounds) | sft+base (contrast pairs: the chosen
    # index is among the policy's answers, the rejected index among the base model's)
    pa.field("policy", pa.string()),
    pa.field("policy_key", pa.string()),  # that policy's content key ("" for base)
    pa.field("temperature", pa.float64()),
    pa.field("top_p", pa.float64()),
    pa.field("samples_per_prompt", pa.int64()),
])
# every sampled answer with the judge's score
PREFERENCE_SAMPLES_SCHEMA = pa.schema([
    pa.field("split", pa.string(), nullable=False),  # train | eval | contrast (the base model's, train prompts)
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("sample_index", pa.int64(), nullable=False),
    pa.field("response", pa.string()),
    pa.field("response_tokens", pa.int64()),
    pa.field("finish_reason", pa.string()),
    pa.field("score", pa.float64()),
])

# ---- ref_logprobs (and the reference cache entries it shares across runs) ------------------------------
REF_LOGPS_SCHEMA = pa.schema(
    [
        pa.field("pair_id", pa.string(), nullable=False),
        pa.field("ref_chosen_logps", pa.float64(), nullable=False),
        pa.field("ref_rejected_logps", pa.float64(), nullable=False),
        pa.field("prompt_tokens", pa.int32(), nullable=False),
        pa.field("chosen_tokens", pa.int32(), nullable=False),
        pa.field("rejected_tokens", pa.int32(), nullable=False),
        pa.field("ref_chosen_token_logps", pa.list_(pa.float32())),  # null unless per_token
        pa.field("ref_rejected_token_logps", pa.list_(pa.float32())),
    ]
)

# ---- kto: its own reference cache ----------------------------------------------------------------------
KTO_REF_SCHEMA = pa.schema(
    [
        pa.field("example_id", pa.string(), nullable=False),
        pa.field("label", pa.bool_(), nullable=False),
        pa.field("ref_logps", pa.float64(), nullable=False),
        pa.field("ref_KL_logps", pa.float64()),  # null for loss_type apo_zero_unpaired (no KL term)
    ]
)

# ---- ppo, grpo (one table per iteration) and rollout: sampled answers ---------------------------------
_SAMPLE = [
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("sample_index", pa.int64(), nullable=False),
    pa.field("prompt", pa.string()),
    pa.field("response", pa.string()),
    pa.field("response_ids", pa.list_(pa.int32())),
    pa.field("logp_rollout", pa.list_(pa.float32())),
]
EXPERIENCE_SCHEMA = pa.schema([
    pa.field("iteration", pa.int64(), nullable=False),
    *_SAMPLE,
    pa.field("logp_old", pa.list_(pa.float32())),
    pa.field("logp_ref", pa.list_(pa.float32())),  # null when no reference model is used (beta 0)
    pa.field("reward", pa.float64()),  # the weighted sum of the terms below
    pa.field("rewards", pa.map_(pa.string(), pa.float64())),  # each reward term's value, by name
    pa.field("advantage", pa.float64()),  # mean over the response tokens
    pa.field("finish_reason", pa.string()),
    # episodes (ppo/grpo.environment): 1 on the policy's tokens, 0 on the environment's; null for single answers
    pa.field("policy_mask", pa.list_(pa.int8())),
    pa.field("env_error", pa.string()),  # the environment's failure that ended the episode
    # updates the sampling policy had had: iteration - 1, or less with rollout.async (the lag)
    pa.field("policy_version", pa.int64()),
])
ROLLOUT_SCHEMA = pa.schema([*_SAMPLE, pa.field("finish_reason", pa.string()), pa.field("reward", pa.float64())])

# ---- eval: the tables `rlhf query` exposes as DuckDB views ---------------------------------------------
EVAL_SCHEMAS = {
    "samples": _schema(("run", S), ("policy", S), ("prompt_id", S), ("sample_index", I), ("prompt", S),
                       ("response", S), ("verifier_score", F), ("correct", B), ("rm_reward", F),
                       ("response_tokens", I), ("log_ratio_to_ref", F), ("finish_reason", S)),
    "battles": _schema(("run", S), ("prompt_id", S), ("sample_index", I), ("judge", S), ("policy_a", S),
                       ("policy_b", S), ("score_a", F), ("tokens_a", I), ("tokens_b", I)),
    # lc_*: length-controlled Elo (rlhf/maths/style_control.py); length_coef: the judge's preference for
    # longer answers in log-odds per unit of normalised length difference, the same on each of its rows
    "ratings": _schema(("run", S), ("judge", S), ("policy", S), ("elo", F), ("ci_low", F), ("ci_high", F),
                       ("battles", I), ("accuracy", F), ("lc_elo", F), ("lc_ci_low", F), ("lc_ci_high", F),
                       ("length_coef", F), ("length_coef_ci_low", F), ("length_coef_ci_high", F)),
    "metrics": _schema(("run", S), ("policy", S), ("name", S), ("value", F)),
    "accuracy_diffs": _schema(("run", S), ("policy_a", S), ("policy_b", S), ("accuracy_diff", F),
                              ("ci_low", F), ("ci_high", F)),
    "run": _schema(("run", S), ("profile", S), ("model", S), ("finished_at", S), ("stage_keys", S), ("config", S)),
}

# ---- the answers cache shared across runs (rlhf/engines/answers.py) ------------------------------------
ANSWERS_SCHEMA = pa.schema([
    pa.field("prompt_index", pa.int64(), nullable=False),
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("sample_index", pa.int64(), nullable=False),
    pa.field("response", pa.string()),
    pa.field("response_ids", pa.list_(pa.int32())),
    pa.field("logprobs", pa.list_(pa.float32())),
    pa.field("finish_reason", pa.string()),
    pa.field("verifier_score", pa.float64()),  # null for open-ended prompts (nothing to verify against)
    # episodes (eval.environment): 1 on the policy's tokens, 0 on the environment's; null for single answers
    pa.field("policy_mask", pa.list_(pa.int8())),
    pa.field("env_error", pa.string()),  # the environment's failure that ended the episode
])
# entries written before episodes were kept: the same columns less the last two, read as single answers
ANSWERS_SCHEMA_V1 = pa.schema(list(ANSWERS_SCHEMA)[:-2])

# ---- `rlhf leaderboard`: every policy the answers cache holds ------------------------------------------
LEADERBOARD_TABLE = ("_leaderboard", "leaderboard.parquet")  # under the store's root
LEADERBOARD_SCHEMA = pa.schema([pa.field(n, t) for n, t in (
    ("prompt_set", S), ("params", S), ("judge", S), ("policy", S), ("run", S), ("elo", F), ("ci_low", F), ("ci_high", F),
    ("lc_elo", F), ("lc_ci_low", F), ("lc_ci_high", F), ("length_coef", F), ("accuracy", F), ("answers", I),
    ("battles", I))])

# ---- the cost of each stage, read back across runs (rlhf/core/ledger.py) -------------------------------
LEDGER_SCHEMA = pa.schema([
    pa.field("run", pa.string()), pa.field("stage", pa.string()), pa.field("key", pa.string()),
    pa.field("started", pa.string()), pa.field("finished", pa.string()), pa.field("resumed_from_step", pa.int64()),
    pa.field("wall_seconds", pa.float64()), pa.field("cpu_seconds", pa.float64()), pa.field("peak_rss_mb", pa.float64()),
    pa.field("peak_gpu_mb", pa.float64()), pa.field("device", pa.string()), pa.field("packages_hash", pa.string()),
    pa.field("tokens", pa.int64()), pa.field("samples", pa.int64()),
])

# by the name a stage's declared output gives (rlhf/core/registry.py, which does not import pyarrow: the CLI
# loads the registry before anything heavy)
BY_NAME = {"metrics": METRICS_SCHEMA, "pairs": PAIRS_SCHEMA, "preference_samples": PREFERENCE_SAMPLES_SCHEMA,
           "ref_logps": REF_LOGPS_SCHEMA, "kto_ref_logps": KTO_REF_SCHEMA, "experience": EXPERIENCE_SCHEMA,
           "rollouts": ROLLOUT_SCHEMA, **{f"eval.{k}": v for k, v in EVAL_SCHEMAS.items()}}
