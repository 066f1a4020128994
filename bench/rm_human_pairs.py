"""Reward models on human preference pairs: which `reward_model.kind` reads them best, and how much of it
is a length preference.

Input: pairs in TRL's conversational format (JSONL, {prompt, chosen, rejected} as messages), or Anthropic's
HH-RLHF transcripts (`--hh file.jsonl.gz`, converted: the shared turns become the prompt, each side's last
assistant turn its answer). Pairs longer than --max-tokens are left out (CPU budget); the first --test pairs
are held out, the next --train train. On the held-out pairs, accuracy (the chosen answer scored higher; a
tie counts half) overall and split by whether the chosen answer is the longer one, for:
  * always pick the longer answer (the baseline a length-biased judge matches);
  * the embedded model before training: summed log-likelihood of the answer (the implicit reward
    untrained) and its per-token mean (length-normalised);
  * with --kinds: each reward-model kind trained on the training pairs by the reward_model stage itself
    (default profile settings, init from the base model), scored as the pipeline scores it; for implicit
    also its per-token mean.

    .venv/bin/python bench/rm_human_pairs.py --hh harmless-base-test.jsonl.gz --kinds implicit classifier
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def hh_pairs(path: Path) -> list[dict]:
    """HH-RLHF rows ({chosen, rejected}: whole transcripts) as conversational pairs sharing their prompt."""
    def turns(text: str) -> list[dict]:
        parts = re.split(r"\n\n(Human|Assistant): ", "\n\n" + text.strip())
        return [{"role": "user" if who == "Human" else "assistant", "content": said.strip()}
                for who, said in zip(parts[1::2], parts[2::2])]

    out = []
    for line in gzip.open(path, "rt"):
        row = json.loads(line)
        c, r = turns(row["chosen"]), turns(row["rejected"])
        if (len(c) >= 2 and c[:-1] == r[:-1] and c[-1]["role"] == r[-1]["role"] == "assistant"
                and c[-1]["content"] and r[-1]["content"] and c[-1]["content"] != r[-1]["content"]):
            out.append({"prompt": c[:-1], "chosen": [c[-1]], "rejected": [r[-1]]})
    return out


def accuracy(chosen: list[float], rejected: list[float], longer: list[bool]) -> dict:
    """Share of pairs whose chosen answer scored higher (ties half), overall and by chosen longer / shorter."""
    hits = [1.0 if c > r else 0.5 if c == r else 0.0 for c, r in zip(chosen, rejected)]
    split = lambda keep: round(sum(h for h, k in zip(hits, longer) if k == keep) / max(1, sum(1 for k in longer if k == keep)), 3)  # noqa: E731
    return {"all": round(sum(hits) / len(hits), 3), "chosen_longer": split(True), "chosen_shorter": split(False)}


def loglik(model, tok, pairs: list[dict]) -> dict[str, list[float]]:
    """Summed and per-token mean log-likelihood of each answer after its prompt (the implicit reward's scoring)."""
    from rlhf.train.rewards import implicit_rewards

    out = {}
    for side in ("chosen", "rejected"):
        conv = [p["prompt"] + p[side] for p in pairs]
        total = implicit_rewards(model, tok, conv)
        n = [len(tok(p[side][0]["content"], add_special_tokens=False)["input_ids"]) + 1 for p in pairs]
        out[f"{side}_sum"], out[f"{side}_mean"] = total, [t / k for t, k in zip(total, n)]
    return out


def train_kind(kind: str, train_file: Path, store: Path):
    """The reward_model stage on the training pairs, default profile settings, from the base model."""
    from rlhf.core.loader import load_config
    from rlhf.pipeline.runner import execute_stage
    from rlhf.train.rewards import load_reward_model

    cfg = load_config(ROOT / "pipeline.yaml", "default", [
        f"storage.url={store}", f"run.name=rm-{kind}", f"data.prefs_path={train_file}", f"reward_model.kind={kind}",
        "reward_model.init_from=base", "reward_model.max_length=256", *[f"{s}.enabled=false" for s in (
            "sft", "preferences", "ref_logprobs", "dpo", "grpo", "eval")]])
    t0 = time.time()
    m = execute_stage(cfg, "reward_model")
    model, tok = load_reward_model(str(store / f"rm-{kind}" / "reward_model" / m["outputs"]["model"]), "float32")
    return model, tok, time.time() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--hh", type=Path, help="HH-RLHF transcripts (.jsonl.gz)")
    src.add_argument("--pairs", type=Path, help="conversational pairs (.jsonl)")
    ap.add_argument("--max-tokens", type=int, default=256, help="leave out pairs longer than this (prompt + longer answer)")
    ap.add_argument("--test", type=int, default=300)
    ap.add_argument("--train", type=int, default=600)
    ap.add_argument("--kinds", nargs="*", default=[], choices=["implicit", "classifier"])
    ap.add_argument("--trained-only", action="store_true", help="skip the untrained model's rows")
    args = ap.parse_args(argv)

    from rlhf.core.config import ModelConfig
    from rlhf.core.models import load_causal_lm, load_tokenizer, resolve_model
    from rlhf.train.rewards import reward_model_scores

    path = resolve_model(ModelConfig())
    tok = load_tokenizer(path)
    pairs = hh_pairs(args.hh) if args.hh else [json.loads(line) for line in args.pairs.read_text().splitlines()]
    size = lambda p: len(tok.apply_chat_template(p["prompt"] + max(p["chosen"], p["rejected"], key=lambda m: len(m[0]["content"])), tokenize=True))  # noqa: E731
    pairs = [p for p in pairs if size(p) <= args.max_tokens]
    test, train = pairs[: args.test], pairs[args.test : args.test + args.train]
    longer = [len(p["chosen"][0]["content"]) > len(p["rejected"][0]["content"]) for p in test]
    report = {"pairs_kept": len(pairs), "test": len(test), "train": len(train),
              "chosen_longer_share": round(sum(longer) / len(test), 3),
              "pick_longer": accuracy([float(k) for k in longer], [float(not k) for k in longer], longer)}
    if not args.trained_only:
        with torch.inference_mode():
            ll = loglik(load_causal_lm(path, ModelConfig()), tok, test)
        report["untrained_sum"] = accuracy(ll["chosen_sum"], ll["rejected_sum"], longer)
        report["untrained_mean"] = accuracy(ll["chosen_mean"], ll["rejected_mean"], longer)
    print(json.dumps(report), flush=True)
    if args.kinds:
        with tempfile.TemporaryDirectory() as tmp:
            train_file = Path(tmp) / "train.jsonl"
            train_file.write_text("".join(json.dumps(p) + "\n" for p in train))
            for kind in args.kinds:
                model, rtok, seconds = train_kind(kind, train_file, Path(tmp) / "store")
                with torch.inference_mode():
                    if kind == "implicit":
                        ll = loglik(model, rtok, test)
                        report["implicit_sum"] = accuracy(ll["chosen_sum"], ll["rejected_sum"], longer)
                        report["implicit_mean"] = accuracy(ll["chosen_mean"], ll["rejected_mean"], longer)
                    else:
                        c = reward_model_scores(model, rtok, [p["prompt"] + p["chosen"] for p in test])
                        r = reward_model_scores(model, rtok, [p["prompt"] + p["rejected"] for p in test])
                        report["classifier"] = accuracy(c, r, longer)
                report[f"{kind}_train_seconds"] = round(seconds, 1)
                print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
