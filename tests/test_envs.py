"""Multi-turn environments: the built-in calculator, the sandbox an environment runs in, episodes whose
environment tokens no loss term sees, and GRPO on episodes through the CLI."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from conftest import run_cli, only
from rlhf.core.config import DataConfig, ModelConfig, TinyModelConfig
from rlhf.core.models import load_causal_lm, load_tokenizer, tiny_model_dir
from rlhf.data.sources import make_task
from rlhf.engines.engine import Generation, SamplingParams, chat_ids
from rlhf.envs.base import load_class
from rlhf.envs.calculator import CalcError, Calculator, evaluate
from rlhf.envs.episodes import episode_stats, problem_payload, run_episodes
from rlhf.envs.feedback import is_right
from rlhf.envs.hanoi import Hanoi
from rlhf.envs.sandbox import Limits, Sandbox
from rlhf.maths import rl_math
from rlhf.train import rl_loop

@pytest.fixture(scope="module")
def tiny_tokenizer():
    return load_tokenizer(str(tiny_model_dir(TinyModelConfig())))


@pytest.fixture()
def tiny_policy():
    torch.manual_seed(0)
    return load_causal_lm(str(tiny_model_dir(TinyModelConfig())), ModelConfig(name="tiny"))


PROBLEM = {"id": "train-0", "question": "What is 2 + 2?", "answer": "4", "columns": {}}


@pytest.mark.parametrize("expression, value", [
    ("123 + 456 * 7", "3315"), ("(1 + 2) * 3", "9"), ("7 / 2", "3.5"), ("7 // 2", "3"), ("-7 % 3", "2"),
    ("2 ** 10", "1024"), ("1 / 3 * 3", "1"), ("0.1 + 0.2", "0.3"), ("2 ** -2", "0.25"),
])
def test_the_calculator_computes_exactly(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("9 ** 9 ** 9", "exponent must be a whole number within"), ("10 ** 31", "exceeds 1e30"),
    ("__import__('os').system('ls')", "Call is not allowed"), ("x + 1", "Name is not allowed"),
    ("1 / 0", "division by zero"), ("(1 + 2", "not an arithmetic expression"), ("1" * 201, "longer than 200"),
    ("'a' * 3", "Constant is not allowed"), ("[1, 2]", "List is not allowed"), ("0 ** -1", "no negative power"),
])
def test_the_calculator_refuses_anything_but_bounded_arithmetic(expression, why):
    with pytest.raises(CalcError, match=why):
        evaluate(expression)


def test_a_calculator_turn_gets_its_result_or_an_error_and_a_turn_without_a_call_ends_the_episode():
    calc = Calculator()
    calc.reset(PROBLEM)
    assert calc.step("First, <calc>12*7</calc>") == ("<result>84</result>", 0.0, False)
    assert calc.step("<calc>12*</calc>") == ("<error>not an arithmetic expression</error>", 0.0, False)
    assert calc.step("The answer is 84.") == (None, 0.0, True)


@pytest.mark.parametrize("cls, error", [
    ("Hangs", "no answer within 1 s (killed)"),
    ("Crashes", "the environment's process died (exit code 3)"),
    ("OpensFiles", "PermissionError: the environment's sandbox refuses open"),
    ("OpensSockets", "PermissionError: the environment's sandbox refuses socket."),
    ("Shells", "PermissionError: the environment's sandbox refuses os.system"),
    ("Eats", "MemoryError"),
    ("WrongType", "TypeError: step returned an observation of type int"),
])
def test_a_tool_that_misbehaves_ends_its_episode_with_the_error_and_the_next_episode_runs(cls, error):
    box = Sandbox(f"envs_hostile:{cls}", Limits(timeout_s=1.0, memory_mb=512))
    try:
        assert box.reset(0, PROBLEM) is None
        step = box.step(0, "<call>")
        assert step.done and step.observation is None and error in step.error, step
        assert box.reset(1, PROBLEM) is None  # a fresh child when the last one was killed or died
    finally:
        box.close()
    assert not os.path.exists("/tmp/rlhf-sandbox-escaped")


def test_a_flood_of_output_is_discarded_and_the_observation_cut():
    box = Sandbox("envs_hostile:Floods", Limits(timeout_s=10.0, max_chars=100))
    try:
        assert box.reset(0, PROBLEM) is None
        step = box.step(0, "<call>")
        assert step.error is None and step.observation == "y" * 100 and not step.done
    finally:
        box.close()


def test_an_environment_that_does_not_import_or_lacks_step_is_named():
    with pytest.raises(ValueError, match="cannot import 'Nope' from 'envs_hostile'"):
        load_class("envs_hostile:Nope")
    with pytest.raises(ValueError, match="NoStep has no step method"):
        load_class("envs_hostile:NoStep")


class Scripted:
    """A stand-in for a policy that has learned the tool's format (the tiny random model never writes a
    call): it says its scripted turns in order, each as if sampled with log-prob -0.5 per token. The
    episode loop, the tokenizer, the environment process and the masks are the real ones."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.calls = tokenizer, turns, []

    def continue_ids(self, seqs, params, stop, seed):
        self.calls.append([len(s) for s in seqs])
        out = []
        for _ in seqs:
            text = self.turns[min(len(self.calls) - 1, len(self.turns) - 1)]
            toks = self.tokenizer(text, add_special_tokens=False)["input_ids"][: params.max_new_tokens]
            end = "tool" if any(s in text for s in stop) else "stop"
            toks = toks + ([self.tokenizer.eos_token_id] if end == "stop" else [])
            out.append((toks, [-0.5] * len(toks), end))
        return out


class Problem:
    def __init__(self, question):
        self.id, self.question, self.answer = "train-0", question, "84"

    def messages(self):
        return [{"role": "user", "content": self.question}]

    def columns(self):
        return {}


def test_a_two_turn_episode_masks_the_environments_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    engine = Scripted(tok, ["Let me compute <calc>12*7</calc>", " so the answer is 84."])
    [g] = run_episodes(engine, [Problem("What is 12 times 7?")], SamplingParams(0.0, 1.0, 32), "calculator", 4, 256)
    t1 = tok("Let me compute <calc>12*7</calc>", add_special_tokens=False)["input_ids"]
    obs = tok("<result>84</result>", add_special_tokens=False)["input_ids"]
    t2 = tok(" so the answer is 84.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert g.token_ids == t1 + obs + t2 and g.mask == [1] * len(t1) + [0] * len(obs) + [1] * len(t2)
    assert g.logprobs == [-0.5] * len(t1) + [0.0] * len(obs) + [-0.5] * len(t2)
    assert g.finish_reason == "stop" and g.error is None and "<result>84</result> so the answer is 84." in g.text
    assert engine.calls[1][0] == engine.calls[0][0] + len(t1) + len(obs)  # turn 2 continues the whole transcript
    assert episode_stats([g]) == {"episode_turns": 2.0, "episode_env_tokens": float(len(obs)), "episode_error_share": 0.0}
    # budgets: one policy turn only, or too few tokens for the observation
    engine = Scripted(tok, ["Let me compute <calc>12*7</calc>", " so the answer is 84."])
    [one] = run_episodes(engine, [Problem("q")], SamplingParams(0.0, 1.0, 32), "calculator", 1, 256)
    assert one.finish_reason == "max_turns" and sum(one.mask) == len(one.mask) == len(t1)


@pytest.mark.parametrize("attempt, answer, right", [
    ("12 + 7 = 19, so the answer is 19.", "19", True), ("The answer is 19.0", "19", True),
    ("It is 1,019", "1019", True), ("19 or maybe 20", "19", False), ("no number", "19", False),
    ("The animal is:\n  the Cat.", "cat", True), ("concat", "cat", False), ("", "cat", False)])
def test_the_feedback_checker_reads_the_last_number_or_the_last_line(attempt, answer, right):
    assert is_right(attempt, answer) is right


def test_a_chat_environment_answers_as_the_next_user_turn_in_the_templates_format(tiny_tokenizer):
    """Feedback: a wrong first attempt is told so as the next user turn; the second is right and ends the
    episode. The transcript is token for token what the chat template makes of the whole conversation, and
    the user turn's tokens (with the template's own separators) are masked out."""
    tok = tiny_tokenizer
    q, a1, a2 = "What is 12 times 7?", "The answer is 80.", "The answer is 84."
    engine = Scripted(tok, [a1, a2])
    opts = {"attempt_cost": 0.25, "message": "Wrong, try again."}
    [g] = run_episodes(engine, [Problem(q)], SamplingParams(0.0, 1.0, 32), "feedback", 3, 256, options=opts)
    convo = [{"role": "user", "content": q}, {"role": "assistant", "content": a1},
             {"role": "user", "content": "Wrong, try again."}, {"role": "assistant", "content": a2}]
    whole = tok(tok.apply_chat_template(convo, tokenize=False), add_special_tokens=False)["input_ids"]
    prompt = chat_ids(tok, convo[:1])
    n1, n2 = (len(tok(a, add_special_tokens=False)["input_ids"]) + 1 for a in (a1, a2))  # with the EOS token
    assert whole[: len(prompt) + len(g.token_ids)] == prompt + g.token_ids  # the template's closing newline after
    assert g.mask[:n1] == [1] * n1 and g.mask[-n2:] == [1] * n2 and set(g.mask[n1:-n2]) == {0}
    assert tok.decode(g.token_ids[n1:-n2]) == "\n<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n"
    assert g.finish_reason == "env_done" and g.rewards == {"env": -0.25} and g.error is None
    assert episode_stats([g])["episode_turns"] == 2.0
    # never right: every turn is spent, and each attempt that got feedback costs
    [g] = run_episodes(Scripted(tok, [a1]), [Problem(q)], SamplingParams(0.0, 1.0, 32), "feedback", 3, 256, options=opts)
    assert g.finish_reason == "stop" and g.rewards == {"env": -0.5} and episode_stats([g])["episode_turns"] == 3.0


def test_a_failing_tool_ends_the_episode_with_its_error(tiny_tokenizer):
    engine = Scripted(tiny_tokenizer, ["<call>x</call>", "never said"])
    [g] = run_episodes(engine, [Problem("q")], SamplingParams(0.0, 1.0, 8), "envs_hostile:Crashes", 4, 256)
    assert g.finish_reason == "env_error" and "process died" in g.error and len(engine.calls) == 1


HANOI = {"id": "train-0", "question": "", "answer": None, "columns": {},
         "metadata": {"num_disks": 2, "num_pegs": 3, "start_peg": 1, "target_peg": 3}}


def test_the_hanoi_game_applies_moves_shows_the_pegs_and_pays_only_a_solved_puzzle():
    """2 disks from peg 1 to peg 3, by hand: 1 -> 2, then 2 -> 3 and 1 -> 3 solves it."""
    game = Hanoi()
    game.reset(HANOI)
    obs, reward, done = game.step("Move disk 1 from Peg 1 to Peg 2")
    assert (reward, done) == (0.0, False)
    assert "After 1 moves the pegs are (bottom to top):\nPeg 1: 2\nPeg 2: 1\nPeg 3: empty\n" in obs
    assert game.step("move disk 2 from peg 1 to peg 3\nMove disk 1 from Peg 2 to Peg 3\nMove disk 1 ...") == (None, 1.0, True)
    for moves, why in (("Move disk 2 from Peg 1 to Peg 2", "disk 2 is not on top of peg 1"),
                       ("Move disk 1 from Peg 1 to Peg 2\nMove disk 2 from Peg 1 to Peg 2",
                        "disk 2 cannot go onto the smaller disk 1 on peg 2"),
                       ("Move disk 1 from Peg 1 to Peg 7", "there is no move from peg 1 to peg 7")):
        game.reset(HANOI)
        assert game.step(moves) == (f"Illegal move: {why}. The game is over.", 0.0, True)
    game.reset(HANOI)
    assert game.step("I give up.") == (None, 0.0, True)  # a turn without a move ends the game
    game.reset(HANOI)
    assert game.step("Move disk " + "1" * 5000 + " from Peg 1 to Peg 2") == (None, 0.0, True)  # no move, no int()


def test_the_hanoi_game_reads_a_prompts_files_question_and_refuses_other_problems():
    game = Hanoi()
    game.reset({"id": "file-3", "question": "Solve the Tower of Hanoi problem with 3 disks and 4 pegs.\n"
                "Move all disks from Peg 2 to Peg 4 following the rules:"})
    assert game.pegs == {1: [], 2: [3, 2, 1], 3: [], 4: []} and game.target == 4
    for problem, why in (({"id": "eval-1", "question": "What is 2 + 2?"}, "prompt eval-1: the hanoi environment needs"),
                         ({"id": "x", "question": "with 40 disks and 3 pegs. Move all disks from Peg 1 to Peg 2"},
                          "not a playable puzzle"),
                         ({"id": "big", "question": "9" * 5000 + " disks and 3 pegs. Move all disks from Peg 1 to Peg 2"},
                          "prompt big: the hanoi environment needs")):
        with pytest.raises(ValueError, match=why):
            game.reset(problem)


def test_a_hanoi_game_of_two_turns_on_reasoning_gyms_problems(tiny_tokenizer):
    """The real task (reasoning-gym's tower_of_hanoi, its metadata sent to the game's process), the real
    episode loop and sandbox; a scripted policy plays one move, reads the pegs, then finishes."""
    cfg = DataConfig(task="reasoning_gym:tower_of_hanoi", train_size=4, eval_size=2,
                     task_params={"min_disks": 2, "max_disks": 2, "min_pegs": 3, "max_pegs": 3})
    problem = make_task(cfg).train[0]
    assert problem_payload(problem)["metadata"]["num_disks"] == 2  # the game's starting position, from reasoning-gym
    start, target = problem.entry["metadata"]["start_peg"], problem.entry["metadata"]["target_peg"]
    aux = 6 - start - target
    first = f"Move disk 1 from Peg {start} to Peg {aux}"
    rest = f"Move disk 2 from Peg {start} to Peg {target}\nMove disk 1 from Peg {aux} to Peg {target}"
    engine = Scripted(tiny_tokenizer, [first, rest])
    [g] = run_episodes(engine, [problem], SamplingParams(0.0, 1.0, 32), "hanoi", 4, 512)
    assert g.finish_reason == "env_done" and g.rewards == {"env": 1.0} and g.error is None
    assert f"Peg {aux}: 1" in g.text and episode_stats([g])["episode_turns"] == 2.0
    # a wrong first move ends the game at once, unpaid
    [g] = run_episodes(Scripted(tiny_tokenizer, [f"Move disk 2 from Peg {start} to Peg {target}"]), [problem],
                       SamplingParams(0.0, 1.0, 32), "hanoi", 4, 512)
    assert g.finish_reason == "env_done" and g.rewards == {} and "Illegal move: disk 2 is not on top" in g.text


def two_turn_batch():
    """Two episodes of one group: policy tokens, 3 environment tokens, policy tokens (rewards 1 and 0)."""
    mask = [1, 1, 0, 0, 0, 1, 1]
    gens = [Generation(0, s, [11 + s, 12, 13, 14, 15, 16, 17], [-0.5 if m else 0.0 for m in mask], "", "stop", mask=mask)
            for s in range(2)]
    return rl_loop.build_batch([[1, 2, 3], [1, 2, 3]], gens, 0), torch.tensor([1.0, 0.0])


def test_a_two_turn_episodes_advantages_are_its_outcome_on_the_policys_tokens_only():
    batch, scores = two_turn_batch()
    assert batch.mask.tolist() == [[1, 1, 0, 0, 0, 1, 1]] * 2
    assert batch.attention_mask[:, 3:].tolist() == [[1] * 7] * 2  # the environment's tokens are context
    cfg = type("C", (), {"group_size": 2, "scale_rewards": "none"})()
    rl_loop.grpo_advantages(cfg, batch, scores, 0.0)
    # r - mean: +0.5 and -0.5 on each policy token, 0 on the environment's
    assert batch.advantages.tolist() == [[0.5, 0.5, 0, 0, 0, 0.5, 0.5], [-0.5, -0.5, 0, 0, 0, -0.5, -0.5]]


def test_ppo_carries_value_and_advantage_across_the_environments_tokens():
    """GAE (Schulman et al. 2016) over the policy's tokens only, gamma 1, lam 0.5, the score 1 on the last
    policy token and no KL; the environment's positions hold garbage values (9) that nothing reads:
      A6 = 1 - .8 = .2;  A5 = (.8 - .6) + .5 * .2 = .3;  the environment's three tokens are skipped;
      A1 = (.6 - .4) + .5 * .3 = .35;  A0 = (.4 - .2) + .5 * .35 = .375;  returns = A + V."""
    batch, _ = two_turn_batch()
    mask = batch.mask[:1]
    rewards = rl_math.kl_penalized_rewards(torch.tensor([1.0]), torch.zeros(1, 7), mask, 0.0)
    assert rewards.tolist() == [[0, 0, 0, 0, 0, 0, 1]]
    values = torch.tensor([[0.2, 0.4, 9, 9, 9, 0.6, 0.8]])
    adv, returns = rl_math.gae(rewards, values, mask, 1.0, 0.5)
    assert adv[0].tolist() == pytest.approx([0.375, 0.35, 0, 0, 0, 0.3, 0.2])
    assert returns[0].tolist() == pytest.approx([0.575, 0.75, 0, 0, 0, 0.9, 1.0])
    # the loop's PPO advantages (whitened over the policy's tokens) stay 0 on the environment's
    cfg = type("C", (), {"gamma": 1.0, "lam": 0.5})()
    batch.logp_old, batch.values = batch.logp_rollout.clone(), values.expand(2, 7).clone()
    rl_loop.ppo_advantages(cfg, batch, torch.tensor([1.0, 0.0]), 0.0)
    assert (batch.advantages[:, 2:5] == 0).all() and (batch.returns[:, 2:5] == 0).all()
    # the episode that scored 1 has the larger advantage on each of the policy's tokens (row 1 scored 0)
    assert ((batch.advantages[0] - batch.advantages[1])[mask[0].bool()] > 0).all()


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_the_environments_tokens_reach_no_loss_term(tiny_policy, algo):
    """Garbage in every per-token input at the environment's positions (old, reference and rollout log-probs,
    advantages, importance weights; PPO's old values and returns) leaves the loss and the gradients (the
    policy's, and PPO's critic's) exactly as they were."""
    models = {"policy": tiny_policy}
    if algo == "ppo":
        from transformers import AutoModelForTokenClassification

        torch.manual_seed(0)
        models["critic"] = AutoModelForTokenClassification.from_pretrained(
            str(tiny_model_dir(TinyModelConfig())), num_labels=1)

    def grads(batch):
        for m in models.values():
            m.zero_grad()
        step = rl_loop.Step(rl_loop.ALGORITHMS[algo], cfg, 1, models, {}, 0.1, 1.0,
                            lambda: torch.autocast("cpu", enabled=False), 8)
        out = rl_loop.micro_step(step, batch, torch.arange(2), 1.0)
        return ({k: v for k, v in out.items() if k.endswith("loss")},
                torch.cat([p.grad.flatten() for m in models.values() for p in m.parameters() if p.grad is not None]))

    cfg = type("C", (), {"group_size": 2, "scale_rewards": "group", "clip_eps": 0.2, "dual_clip": None,
                         "clip_eps_high": None, "beta": 0.1, "loss_type": "dapo", "gamma": 1.0, "lam": 0.95,
                         "entropy_coef": 0.01, "vf_coef": 0.1, "value_clip": 0.2})()
    batch, scores = two_turn_batch()
    with torch.no_grad():
        batch.logp_old = rl_loop.score_all(tiny_policy, batch, 1.0, 2) + 0.05 * batch.mask
        batch.logp_ref = batch.logp_old - 0.1 * batch.mask
        if algo == "ppo":
            batch.values = rl_loop.score_all(models["critic"], batch, 1.0, 2, values=True) + 0.3 * batch.mask
    rl_loop.ALGORITHMS[algo].advantages(cfg, batch, scores, 0.1)
    batch.weights = torch.ones_like(batch.mask)
    losses, grad = grads(batch)
    env = batch.mask == 0
    noise = torch.randn(batch.mask.shape) * 7
    names = ["logp_old", "logp_ref", "logp_rollout", "advantages", "weights"] + (["values", "returns"] if algo == "ppo" else [])
    for name in names:
        setattr(batch, name, torch.where(env, noise, getattr(batch, name)))
    losses2, grad2 = grads(batch)
    assert set(losses) == ({"policy_loss", "value_loss"} if algo == "ppo" else {"policy_loss"})
    assert grad.abs().sum() > 0 and losses2 == pytest.approx(losses, abs=0) and torch.equal(grad, grad2)


@pytest.mark.slow  # SFT, GRPO with the calculator and PPO with feedback (sampling on their own thread), eval on episodes: the CLI
def test_episodes_through_the_cli_asynchronous_grpo_and_ppo_then_eval_on_episodes(tmp_path):
    store = tmp_path / "store"
    env = "{name: calculator, max_turns: 3, max_tokens: 48}"
    feedback = "{name: feedback, max_turns: 3, max_tokens: 48, options: {attempt_cost: 0.5}}"
    sets = [*only("sft", "ppo", "grpo"), f"grpo.environment={env}", "grpo.iterations=2", "rollout.async.max_lag=1",
            "grpo.logp_old=rollout", f"ppo.environment={feedback}", "ppo.iterations=2", "ppo.prompts_per_iteration=2",
            "ppo.minibatch_size=2", "ppo.eval_prompts=4", "ppo.logp_old=rollout",
            "eval.enabled=true", "eval.policies=[base, sft, grpo]", "eval.judge=verifier", f"eval.environment={feedback}"]
    args = ["--profile", "tiny", "--set", f"storage.url={store}", *[a for o in sets for a in ("--set", o)]]
    shown = run_cli("validate", *args)
    assert shown.returncode == 0, shown.stderr
    assert "grpo environment: rlhf.envs.calculator:Calculator, episodes of up to 3 turns and 48 tokens" in shown.stdout
    assert "ppo environment: rlhf.envs.feedback:Feedback with attempt_cost=0.5, episodes of up to 3 turns" in shown.stdout
    assert "eval: episodes with rlhf.envs.feedback:Feedback with attempt_cost=0.5, up to 3 turns and 48 tokens" in shown.stdout
    done = run_cli("run", "--run-name", "tools", *args)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    manifest = json.loads((store / "tools" / "grpo" / "manifest.json").read_text())
    assert 0.0 <= manifest["metrics"]["grpo/episode_success"] <= 1.0
    assert manifest["metrics"]["grpo/held_out_episode_turns"] >= 1.0
    assert manifest["metrics"]["grpo/rollout_lag"] == 1.0  # iteration 2 sampled with the initial policy
    import pyarrow.parquet as pq

    table = pq.read_table(store / "tools" / "grpo" / "experience").to_pylist()
    assert table and all(r["policy_mask"] is not None and len(r["policy_mask"]) == len(r["response_ids"]) <= 48
                         for r in table)
    assert all(r["finish_reason"] in ("stop", "length", "max_turns", "env_done", "env_error") for r in table)
    assert {(r["iteration"], r["policy_version"]) for r in table} == {(1, 0), (2, 0)}
    # PPO on feedback episodes (the masks and the advantages across them are the tests above), its critic beside
    ppo = pq.read_table(store / "tools" / "ppo" / "experience").to_pylist()
    assert len(ppo) == 4 and all(len(r["policy_mask"]) == len(r["response_ids"]) <= 48 for r in ppo)
    assert all(r["finish_reason"] in ("stop", "length", "max_turns", "env_done") for r in ppo)
    ppo_metrics = json.loads((store / "tools" / "ppo" / "manifest.json").read_text())["metrics"]
    assert 0.0 <= ppo_metrics["ppo/episode_success"] <= 1.0 and ppo_metrics["ppo/held_out_episode_turns"] >= 1.0
    assert math.isfinite(ppo_metrics["ppo/value_loss"])
    # every policy played the same episodes; the metrics say how long they were, queryable in DuckDB
    q = run_cli("query", "--format", "json", "--set", f"storage.url={store}",
                "SELECT policy, value FROM metrics WHERE run = 'tools' AND name = 'episode_turns' ORDER BY policy")
    assert q.returncode == 0, q.stderr
    turns = json.loads(q.stdout)
    assert [r["policy"] for r in turns] == ["base", "grpo", "sft"] and all(1.0 <= r["value"] <= 3.0 for r in turns)
    samples = pq.read_table(store / "tools" / "eval" / "samples.parquet").to_pylist()
    assert len(samples) == 3 * 8 and {r["policy"] for r in samples} == {"base", "sft", "grpo"}


def test_an_environment_that_cannot_run_is_refused_before_the_run(tmp_path):
    base = ["validate", "--profile", "tiny", "--set", f"storage.url={tmp_path}", "--set", "grpo.enabled=true",
            "--set", "grpo.environment={name: calculator}"]
    for extra, why in ((["--set", "grpo.environment={name: 'os:system; rm'}"], "grpo.environment.name"),
                       (["--set", "grpo.environment={name: 'envs_hostile:NoStep'}"], "NoStep has no step method"),
                       (["--set", "grpo.environment={name: feedback, options: {attempt_cost: 2}}"],
                        "attempt_cost must be a number in [0, 1], not 2"),
                       (["--set", "grpo.environment={name: calculator, options: {depth: 1}}"],
                        "options {'depth': 1} do not fit Calculator()"),
                       (["--set", "grpo.environment={name: feedback, options: {'a b': 1}}"], "grpo.environment.options")):
        proc = run_cli(*base, *extra, env={"PYTHONPATH": os.path.dirname(__file__)})
        assert proc.returncode == 2 and why in proc.stderr, (extra, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr


def test_a_crashed_rl_stage_on_episodes_closes_its_environment_and_resumes_each_prompt_once(tiny_cfg, monkeypatch):
    """A crash after iteration 3 (checkpoint at 2): the environment's process goes with the failed stage
    (not when the worker exits), and the resume replays iterations 3 and 4, each on its own prompts."""
    import multiprocessing
    import random

    from rlhf.core.store import ArtifactStore
    from rlhf.data.sources import make_task
    from rlhf.pipeline.runner import execute_stage
    from rlhf.train.training import CRASH_ENV, InjectedCrash
    from test_async_rollout import GRPO, experience
    from test_rl import _digest, rl_cfg

    cfg = rl_cfg(tiny_cfg, "grpo", *GRPO, "grpo.iterations=4", "grpo.save_every=2",
                 "grpo.environment={name: feedback, max_turns: 2, max_tokens: 24}")
    store = ArtifactStore(cfg.storage)
    children = set(multiprocessing.active_children())
    monkeypatch.setenv(CRASH_ENV, "grpo:3")
    with pytest.raises(InjectedCrash) as crashed:  # held, as an orchestrator holds a failed task's error
        execute_stage(cfg, "grpo")
    # the sandbox was closed with the stage, not left to the garbage collector of the error's frames
    assert set(multiprocessing.active_children()) <= children, crashed.value
    path = lambda i: store.stage_path(cfg.run.name, "grpo", "experience", f"iter-{i:06d}.parquet")  # noqa: E731
    before = {i: _digest(store, path(i)) for i in (1, 2)}
    monkeypatch.delenv(CRASH_ENV)
    m = execute_stage(cfg, "grpo")
    assert m["status"] == "resumed" and m["resumed_from_step"] == 2
    assert {i: _digest(store, path(i)) for i in (1, 2)} == before  # the checkpoint's iterations: not rewritten
    task = make_task(cfg.data)
    for it in (1, 2, 3, 4):
        rows = experience(cfg, it)
        assert all(r["policy_mask"] is not None for r in rows)
        drawn = random.Random(cfg.run.seed * 7919 + it).sample(task.rl, cfg.grpo.prompts_per_iteration)
        assert sorted((r["prompt_id"], r["sample_index"]) for r in rows) == sorted(
            (p.id, s) for p in drawn for s in range(cfg.grpo.group_size)), it
