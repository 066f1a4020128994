"""Multi-turn rollouts: each (prompt, sample) is an episode. Every round, the live episodes' policy turns are
generated in one batched call (HFEngine.continue_ids); a turn that ends in a tool call (or, for a chat
environment, at the end of the policy's chat turn) goes to the episode's environment (sandbox.py), whose
observation is appended as tokens the policy did not produce: mask 0 and log-prob 0, so the loss, the KL
and the importance ratios never see them (rl_loop.build_batch takes the mask). A chat environment's
observation is the next user turn, in the chat template's own format. An episode ends at the policy's
end-of-sequence token (for a chat environment: when the environment says done or has nothing to say),
when the environment says done or fails, after `max_turns` policy turns, or at `max_tokens` in all. The result is one Generation per episode,
ordered by (prompt, sample) as the single-turn engine orders them."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.engines.engine import Generation, SamplingParams, chat_ids
from rlhf.envs.base import load_class, problem_payload
from rlhf.envs.sandbox import Limits, Sandbox


@dataclass
class Episode:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    env_reward: float = 0.0
    finish: str = ""
    error: str | None = None

    def add(self, tokens: list[int], logprobs: list[float], policy: bool) -> None:
        self.tokens += tokens
        self.logprobs += logprobs if policy else [0.0] * len(tokens)
        self.mask += [int(policy)] * len(tokens)


def chat_observation_ids(tok, messages: list[dict], observation: str) -> list[int]:
    """The tokens that follow the policy's end-of-turn token to carry `observation` as the next user turn
    and open the assistant's next one, as the chat template writes a conversation (for ChatML:
    `\\n<|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n`)."""
    said = [*messages, {"role": "assistant", "content": "A"}]
    before = tok.apply_chat_template(said, tokenize=False)
    after = tok.apply_chat_template([*said, {"role": "user", "content": observation}], tokenize=False,
                                    add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("a chat environment needs a chat template that extends a conversation by appending to it; "
                         "this model's template rewrites earlier turns")
    end = before.rfind(tok.eos_token) if tok.eos_token else -1  # the policy wrote up to its end-of-turn token
    text = (before[end + len(tok.eos_token):] if end >= 0 else "") + after[len(before):]
    return tok(text, add_special_tokens=False)["input_ids"]


def run_episodes(engine, problems, params: SamplingParams, env: str, max_turns: int, max_tokens: int,
                 limits: Limits = Limits(), sandbox: Sandbox | None = None, options: dict | None = None,
                 shard: tuple[int, int] = (0, 1), chunk: int | None = None) -> list[Generation]:
    """The episodes of every (problem, sample): params.max_new_tokens bounds each policy turn.

    `chunk`: episodes are played in fixed chunks of this many (by their place in (prompt, sample) order),
    each chunk's turns batched and seeded on their own, so rank r of `shard` = (r, world) plays chunks r,
    r + world, ... and the union of the ranks' episodes is the one-process result. None: one chunk (every
    live episode in each turn's batch). Returns this rank's episodes."""
    tok = engine.tokenizer
    cls = load_class(env)
    stop, chat = tuple(getattr(cls, "stop", ())), bool(getattr(cls, "chat", False))
    own = sandbox is None
    box = sandbox or Sandbox(env, limits, options)
    total = len(problems) * params.n  # episode eid is (prompt eid // n, sample eid % n)
    size = chunk or max(total, 1)
    mine = [range(start, min(start + size, total)) for start in range(0, total, size)][shard[0] :: shard[1]]
    prompt_ids: dict[int, list[int]] = {}  # this rank's prompts, each tokenized once

    def episode(eid: int) -> tuple[int, Episode]:
        i = eid // params.n
        if i not in prompt_ids:
            prompt_ids[i] = chat_ids(tok, problems[i].messages())
        return eid, Episode(i, eid % params.n, prompt_ids[i])

    chunks = [[episode(eid) for eid in eids] for eids in mine]
    try:
        for c, chunk_eps in enumerate(chunks):
            seed = params.seed + 104_729 * (shard[0] + c * shard[1])  # the chunk's global index
            _play_chunk(engine, tok, box, problems, chunk_eps, params, stop, chat, max_turns, max_tokens, seed)
    finally:
        if own:
            box.close()
    return [Generation(ep.prompt_index, ep.sample_index, ep.tokens, ep.logprobs,
                       tok.decode(ep.tokens, skip_special_tokens=True), ep.finish,
                       rewards={"env": ep.env_reward} if ep.env_reward else {}, mask=ep.mask, error=ep.error)
            for chunk_eps in chunks for _, ep in chunk_eps]


def _play_chunk(engine, tok, box: Sandbox, problems, chunk: list[tuple[int, Episode]], params: SamplingParams,
                stop: tuple[str, ...], chat: bool, max_turns: int, max_tokens: int, seed: int) -> None:
    """Every turn of one chunk's episodes, in place."""
    for eid, ep in chunk:
        if (why := box.reset(eid, problem_payload(problems[ep.prompt_index]))) is not None:
            ep.finish, ep.error = "env_error", why
    for turn in range(max_turns):
        live = [(eid, ep) for eid, ep in chunk if not ep.finish]
        if not live:
            break
        budget = [max_tokens - len(ep.tokens) for _, ep in live]
        one = SamplingParams(params.temperature, params.top_p, max(1, min(params.max_new_tokens, min(budget))),
                             1, params.seed)
        outs = engine.continue_ids([ep.prompt_ids + ep.tokens for _, ep in live], one, stop, seed + 7919 * turn)
        for (eid, ep), (toks, logps, why) in zip(live, outs):
            ep.add(toks, logps, policy=True)
            ep.turns += 1
            handover = why == "tool" or (chat and why == "stop")
            if not handover or turn == max_turns - 1:  # no answer the policy could not follow up
                ep.finish = why if why != "tool" else "max_turns"
                continue
            step = box.step(eid, tok.decode(toks, skip_special_tokens=True))
            ep.env_reward += step.reward
            if step.error is not None:
                ep.finish, ep.error = "env_error", step.error
                continue
            if why == "stop" and not step.observation:  # a chat turn the environment does not answer
                ep.finish = "env_done" if step.done else "stop"
                continue
            if step.observation:
                obs = (chat_observation_ids(tok, problems[ep.prompt_index].messages(), step.observation) if why == "stop"
                       else tok(step.observation, add_special_tokens=False)["input_ids"])
                ep.add(obs[: max(0, max_tokens - len(ep.tokens))], [], policy=False)
            if step.done:
                ep.finish = "env_done"
            elif len(ep.tokens) >= max_tokens:
                ep.finish = "length"
    for eid, ep in chunk:
        ep.finish = ep.finish or "max_turns"
        box.end(eid)


def play(engine, problems, params: SamplingParams, cfg, sandbox: Sandbox | None = None,
         shard: tuple[int, int] = (0, 1), chunk: int | None = None) -> list[Generation]:
    """run_episodes with an environment section's settings (ppo.environment, grpo.environment, eval.environment)."""
    return run_episodes(engine, problems, params, cfg.name, cfg.max_turns, cfg.max_tokens, limits(cfg), sandbox,
                        cfg.options, shard, chunk)


def limits(cfg) -> Limits:
    """The sandbox bounds an environment section sets."""
    return Limits(cfg.timeout_s, cfg.memory_mb, cfg.max_observation_chars)


class EpisodeEngine:
    """The RL loop's engine when `ppo.environment` or `grpo.environment` is set: episodes instead of single
    answers, over the configured rollout engine (the HF engine on the policy's weights, vLLM, or an engine
    actor), with one sandboxed environment process per rank."""

    def __init__(self, engine, cfg, chunk: int):
        self.engine, self.cfg, self.chunk = engine, cfg, chunk
        self.box = Sandbox(cfg.name, limits(cfg), cfg.options)

    def episodes(self, problems, params: SamplingParams, shard: tuple[int, int] = (0, 1)) -> list[Generation]:
        """This rank's share of the episodes (run_episodes' chunks): the ranks' union is one process's."""
        return play(self.engine, problems, params, self.cfg, sandbox=self.box, shard=shard, chunk=self.chunk)

    def sync(self, policy):
        return self.engine.sync(policy)

    def close(self) -> None:
        self.box.close()
        self.engine.close()


def episode_stats(gens: list[Generation]) -> dict[str, float]:
    """Per-episode means for the metrics: policy turns, environment tokens, the share ended by an error."""
    n = max(len(gens), 1)
    turns = [1 + sum(1 for a, b in zip(g.mask, g.mask[1:]) if a == 0 and b == 1) if g.mask else 1 for g in gens]
    return {"episode_turns": sum(turns) / n, "episode_env_tokens": sum(len(g.mask or []) - sum(g.mask or []) for g in gens) / n,
            "episode_error_share": sum(g.error is not None for g in gens) / n}
