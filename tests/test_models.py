"""The embedded default model loads and generates offline; the tiny model builds with the same tokenizer."""

from __future__ import annotations

import pytest
import torch

from rlhf.core.config import ModelConfig, TinyModelConfig
from rlhf.engines.engine import HFEngine, SamplingParams, chat_ids
from rlhf.core.models import load_causal_lm, load_tokenizer, resolve_model


def greedy(model, tok, prompts, max_new_tokens):
    return [g.text for g in HFEngine(model, tok).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))]


def test_tiny_model_builds_with_the_embedded_tokenizer():
    path = resolve_model(ModelConfig(name="tiny"))
    model, tok = load_causal_lm(path, ModelConfig(name="tiny")), load_tokenizer(path)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert model.config.vocab_size == len(tok) == 49152
    assert "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    out = greedy(model, tok, [[{"role": "user", "content": "1 + 1 ="}]], max_new_tokens=3)
    assert len(out) == 1
    # Same config -> same folder and identical weights (init is seeded); another config -> another folder.
    assert resolve_model(ModelConfig(name="tiny")) == path
    other = resolve_model(ModelConfig(name="tiny", tiny=TinyModelConfig(init_seed=1)))
    assert other != path


def test_missing_local_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.name: local path"):
        resolve_model(ModelConfig(name=str(tmp_path / "nothing")))


@pytest.mark.slow
def test_embedded_default_loads_and_generates():
    cfg = ModelConfig()
    path = resolve_model(cfg)
    model, tok = load_causal_lm(path, cfg), load_tokenizer(path)
    n_params = sum(p.numel() for p in model.parameters())
    assert 134_000_000 < n_params < 135_000_000
    assert model.dtype == torch.float32
    prompts = [[{"role": "user", "content": "What is 2 + 3? Answer with a number."}], [{"role": "user", "content": "Say hello."}]]
    out = greedy(model, tok, prompts, max_new_tokens=12)
    assert len(out) == 2 and all(o.strip() for o in out)
    assert "5" in out[0]


def test_shared_prompt_prefill_gives_the_same_samples():
    """Samples of one prompt share its prefill (HFEngine.share_prompts): the same token ids and sampler
    log-probs as one prefill per sample. Prompts of different lengths (left padding) and a batch size
    that splits a prompt's samples over two batches."""
    path = resolve_model(ModelConfig(name="tiny"))
    model, tok = load_causal_lm(path, ModelConfig(name="tiny")), load_tokenizer(path)
    prompts = [[{"role": "user", "content": text}] for text in ("1 + 1 =", "12 - 47 =", "what is 3 + 4 + 5?")]
    params = SamplingParams(temperature=1.0, max_new_tokens=5, n=3, seed=7)
    shared = HFEngine(model, tok, batch_size=4).generate(prompts, params)
    plain = HFEngine(model, tok, batch_size=4, share_prompts=False).generate(prompts, params)
    assert [(g.prompt_index, g.sample_index) for g in shared] == [(i, s) for i in range(3) for s in range(3)]
    assert [g.token_ids for g in shared] == [g.token_ids for g in plain]
    for a, b in zip(shared, plain):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    # the shared path really ran: each batch's distinct prompts, with the chat template's prefix run once
    from rlhf.engines import prefix

    calls, original = [], prefix.forward
    def recording(model, ids, *a, **kw):
        out, c = original(model, ids, *a, **kw)
        calls.append((ids.shape[0], c))
        return out, c
    prefix.forward = recording
    try:
        HFEngine(model, tok, batch_size=4).generate(prompts, params)
    finally:
        prefix.forward = original
    ids = [chat_ids(tok, p) for p in prompts]
    system_turn = len(chat_ids(tok, [{"role": "system", "content": "x"}], generation_prompt=False)) - 3  # up to 'x<|im_end|>\n'
    assert calls[0][1] == prefix.common_prefix(ids[:2]) and calls[1][1] == prefix.common_prefix(ids[1:])
    assert calls[0][1] >= system_turn and calls[-1][1] == 0  # the template's whole system turn is shared


def test_the_lm_head_gets_a_contiguous_input_and_the_same_logits():
    """transformers hands the head a slice of the hidden states (`logits_to_keep`); load_causal_lm makes it
    contiguous first (contiguous_lm_head: a frozen head on a view took 1.7 s per batch in bfloat16 on CPU).
    The head must see a contiguous tensor, frozen or not, and the logits must not change."""
    path = resolve_model(ModelConfig(name="tiny"))
    model = load_causal_lm(path, ModelConfig(name="tiny")).eval().requires_grad_(False)
    seen = []
    model.get_output_embeddings().register_forward_pre_hook(lambda _m, args: seen.append(args[0].is_contiguous()))
    ids = torch.randint(0, 49152, (3, 9))
    with torch.no_grad():
        last = model(input_ids=ids, logits_to_keep=2).logits
        full = model(input_ids=ids).logits
    assert seen == [True, True]
    assert torch.equal(last, full[:, -2:])
    # loaded without it, the same call hands the head a view (the hook is what makes it contiguous), and
    # its logits are the hooked model's
    from transformers import AutoModelForCausalLM

    plain, seen_plain = AutoModelForCausalLM.from_pretrained(path), []
    plain.get_output_embeddings().register_forward_pre_hook(lambda _m, args: seen_plain.append(args[0].is_contiguous()))
    with torch.no_grad():
        plain_last = plain(input_ids=ids, logits_to_keep=2).logits
    assert seen_plain == [False]
    torch.testing.assert_close(plain_last, last)
