"""TRL's DPOTrainer fed reference log-probs from columns of its dataset: the durable cache (the dpo stage),
or zeros (the implicit reward model: a reference that gives every answer the same likelihood).

TRL 1.16 has no option to accept user-supplied reference log-probs (its DPOConfig has none; checked in trl
1.16): with precompute_ref_log_probs=True it builds no reference model, and `CachedRefDPOTrainer` makes
its precompute step return the dataset unchanged because the columns are already there. trl is pinned
(pyproject.toml) and tests/test_dpo.py fails if a reference model is ever built.
"""

from __future__ import annotations

from trl import DPOTrainer

from rlhf.engines.logprobs import CompletionOnlyScoring
from rlhf.engines.prefix import SharedPrefixLoss

REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


class CachedRefDPOTrainer(SharedPrefixLoss, CompletionOnlyScoring, DPOTrainer):
    """DPOTrainer whose reference log-probs always come from the dataset (our durable cache), scoring
    completion positions only (rlhf/engines/logprobs.py `completion_only_scoring`), with each batch's shared
    prompt prefix run once (rlhf/engines/prefix.py)."""

    def _precompute_ref_logps(self, dataset, name, batch_size):
        missing = [c for c in REF_COLUMNS if c not in dataset.column_names]
        if missing:
            raise ValueError(f"{name} dataset lacks cached reference columns {missing}; refusing an on-the-fly reference pass")
        return dataset


def with_reference(rows: list[dict], ref_rows: list[dict]) -> tuple[list[dict], int]:
    """Attach cached log-probs by pair_id; pairs the ref stage dropped (over-long) are left out."""
    ref = {r["pair_id"]: r for r in ref_rows}
    joined = [
        {**{k: v for k, v in row.items() if k != "pair_id"}, **{c: ref[row["pair_id"]][c] for c in REF_COLUMNS}}
        for row in rows
        if row["pair_id"] in ref
    ]
    if not joined:
        raise ValueError("no preference pair has a cached reference log-prob: ref_logprobs and dpo disagree on data")
    return joined, len(rows) - len(joined)
