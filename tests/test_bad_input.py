"""Bad input, as a careless user or an attacker writes it: every case exits 2 before any work, with a
line naming the key path or the file and line, no traceback, nothing written to the store. One table
(config values, config files, data files, CLI arguments), run in-process through typer's test runner;
then a property-based fuzz of config values. One case also runs the installed console command."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import flows.rlhf_flow
from conftest import CONFIG, run_cli
from rlhf.cli.main import app
from rlhf.core.config import PipelineConfig
from test_config import laughs

PAIRS_OFF = ["preferences.enabled=false"]  # user preference files need the on-policy pairs stage off


def write(folder: Path, name: str, content: bytes | str) -> str:
    path = folder / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return str(path)


def truncated_parquet(folder: Path) -> str:
    whole = folder / "whole.parquet"
    pq.write_table(pa.table({"prompt": ["p"] * 50, "chosen": ["a"] * 50, "rejected": ["b"] * 50}), whole)
    return write(folder, "cut.parquet", whole.read_bytes()[: whole.stat().st_size // 2])


LINE = '{"prompt": "p", "chosen": "a", "rejected": "b"}\n'

# (id, --set overrides, extra CLI arguments, config file text or None, data files {name: content}, expected)
# Data file names are substituted for {name} in the overrides; "{bad}" is the config written from the text.
CASES = [
    # values: types and bounds
    ("unknown-key", ["sft.learning_rat=0.1"], [], None, {}, "sft.learning_rat: unknown key; allowed: "),
    ("not-an-int", ["sft.per_device_batch_size=abc"], [], None, {}, "sft.per_device_batch_size: input should be a valid integer"),
    ("bool-as-int", ["sft.per_device_batch_size=true"], [], None, {}, "sft.per_device_batch_size: must be a number, got true"),
    ("bool-as-float", ["rollout.temperature=false"], [], None, {}, "rollout.temperature: must be a number, got false"),
    ("bad-literal", ["dpo.loss_type=hinge"], [], None, {}, "dpo.loss_type: must be one of 'sigmoid', 'ipo' or 'robust', got 'hinge'"),
    ("grpo-scale", ["grpo.scale_rewards=std"], [], None, {}, "grpo.scale_rewards: must be one of 'group', 'batch' or 'none', got 'std'"),
    ("tis-rollout", ["grpo.sampler_correction=token_truncate"], [], None, {},
     "grpo.sampler_correction: needs logp_old: recompute"),
    ("group-size", ["grpo.group_size=1"], [], None, {}, "grpo.group_size: must be >= 2, got 1"),
    ("lr-zero", ["sft.learning_rate=0"], [], None, {}, "sft.learning_rate: must be > 0.0, got 0"),
    ("lr-nan", ["sft.learning_rate=.nan"], [], None, {}, "sft.learning_rate: input should be a finite number"),
    ("inf-temperature", ["rollout.temperature=.inf"], [], None, {}, "rollout.temperature: input should be a finite number"),
    ("inf-backoff", ["storage.backoff_seconds=.inf"], [], None, {}, "storage.backoff_seconds: input should be a finite number"),
    ("inf-max-kl", ["grpo.max_kl=.inf"], [], None, {}, "grpo.max_kl: input should be a finite number"),
    ("inf-epochs", ["sft.num_epochs=.inf"], [], None, {}, "sft.num_epochs: input should be a finite number"),
    ("seed-negative", ["run.seed=-1"], [], None, {}, "run.seed: must be >= 0, got -1"),
    ("seed-2^32", ["run.seed=4294967296"], [], None, {}, "run.seed: must be < 4294967296"),
    ("data-seed", ["data.seed=2147483648"], [], None, {}, "data.seed: must be < 2147483648"),
    ("max-steps-10^400", ["sft.max_steps=1" + "0" * 400], [], None, {}, "sft.max_steps: must be <= 100000000"),
    ("train-size-10^30", ["data.train_size=1" + "0" * 30], [], None, {}, "data.train_size: must be <= 1000000"),
    ("eval-size-10^6", ["data.eval_size=1000000"], [], None, {}, "data.eval_size: must be <= 100000"),
    ("attempts", ["storage.attempts=1000"], [], None, {}, "storage.attempts: must be <= 100"),
    # cross-field rules
    ("minibatch", ["grpo.minibatch_size=12"], [], None, {}, "grpo.minibatch_size: must divide the rollouts per iteration"),
    ("anchor", ["eval.anchor=ppo"], [], None, {}, "eval.anchor: must be one of eval.policies"),
    ("eval-prompts", ["eval.prompts=1000"], [], None, {}, "eval.prompts: at most data.eval_size"),
    ("rm-no-steps", [*PAIRS_OFF, "data.train_size=1"], [], None, {}, "data.train_size: 1 synthetic pairs leave none to train the reward model"),
    ("both-pairs", ["data.prefs_path={prefs.jsonl}"], [], None, {"prefs.jsonl": LINE}, "preferences.enabled: data.prefs_path is set too"),
    ("tiny-heads", ["model.name=tiny", "model.tiny.num_heads=3"], [], None, {}, "model.tiny.hidden_size: must be divisible by num_heads (3), got 64"),
    ("rm-needs-sft", ["sft.enabled=false"], [], None, {}, "reward_model.init_from: 'sft' needs sft.enabled: true"),
    ("dpo-length", ["dpo.max_length=64", "ref_logprobs.max_length=128"], [], None, {},
     "dpo.max_length: must equal ref_logprobs.max_length (128)"),
    ("eval-policy-off", ["eval.policies=[sft, ppo]"], [], None, {}, "eval.policies: 'ppo' needs ppo.enabled: true"),
    ("eval-one-policy", ["eval.policies=[sft]"], [], None, {}, "eval.policies: need at least two distinct policies"),
    ("reward-fn", ["grpo.reward_source=function"], [], None, {}, "grpo.reward_function: set it exactly when reward_source is 'function'"),
    ("smoothing", ["dpo.label_smoothing=0.1"], [], None, {}, "dpo.label_smoothing: only loss_type 'robust' uses it"),
    ("greedy-samples", ["eval.samples_per_prompt=4"], [], None, {}, "eval.samples_per_prompt: greedy decoding (temperature 0) gives one sample"),
    ("dpo-rounds-no-prefs", [*PAIRS_OFF, "dpo.rounds=2"], [], None, {}, "dpo.rounds: 2 rounds sample and judge with the preferences settings"),
    ("dpo-rounds-prompts", ["dpo.rounds=4"], [], None, {}, "dpo.rounds: 3 later rounds of 384 fresh prompts need data.rl_size >= 1152, got 1024"),
    ("rl-pool", ["grpo.prompts_per_iteration=2000", "grpo.minibatch_size=8"], [], None, {},
     "grpo.prompts_per_iteration: each iteration draws distinct prompts from the RL pool of 1024 (data.rl_size, or data.train_size when it is 0), got 2000"),
    ("dpo-rounds-max", ["dpo.rounds=17"], [], None, {}, "dpo.rounds: must be <= 16, got 17"),
    ("prefs-k", ["preferences.samples_per_prompt=1"], [], None, {}, "preferences.samples_per_prompt: must be >= 2, got 1"),
    ("nodes-split", ["sft.launch.nnodes=3", "sft.launch.processes=4", "sft.launch.rendezvous=127.0.0.1:29500"], [], None, {},
     "sft.launch.nnodes: processes (4) must split evenly over 3 nodes"),
    ("nodes-rendezvous", ["sft.launch.nnodes=2", "sft.launch.processes=2"], [], None, {}, "sft.launch.rendezvous: 2 nodes need node 0's host:port"),
    ("nodes-ray", ["sft.launch.nnodes=2", "sft.launch.processes=2", "sft.launch.backend=ray", "sft.launch.rendezvous=h:1"], [], None, {},
     "sft.launch.nnodes: 2 nodes is a torchrun setting"),
    ("rendezvous-port", ["sft.launch.nnodes=2", "sft.launch.processes=2", "sft.launch.rendezvous=h:70000"], [], None, {},
     "sft.launch.rendezvous: port must be 1-65535, got 70000"),
    ("ray-address", ["sft.launch.backend=ray", "sft.launch.ray.address=ray://head:10001"], [], None, {},
     "sft.launch.ray.address: string should match pattern"),
    ("engine-not-rl", ["sft.launch.backend=ray", "sft.launch.ray.engine=own"], [], None, {},
     "sft.launch: ray.engine and ray.scorers 'own' are for the RL stages (ppo, grpo)"),
    ("scorers-none", ["grpo.launch.backend=ray", "grpo.launch.ray.scorers=own", "grpo.beta=0"], [], None, {},
     "grpo.launch.ray.scorers: 'own' but this grpo has no frozen model to place"),
    ("engine-not-ray", ["grpo.launch.ray.engine=own"], [], None, {},
     "grpo.launch.backend: ray.engine 'own' places an actor in the stage's Ray placement group, so it needs backend 'ray', got 'torchrun'"),
    ("ppo-minibatch", ["ppo.enabled=true", "ppo.prompts_per_iteration=3"], [], None, {}, "ppo.minibatch_size: must divide the rollouts per iteration (3"),
    ("task-name", ["data.task=chain_sum"], [], None, {}, "data.task: must look like 'reasoning_gym:<name>'"),
    ("dpo-no-cache", ["ref_logprobs.enabled=false"], [], None, {}, "dpo.enabled: DPO reads cached reference log-probs"),
    # storage, names, secrets
    ("empty-url", ["storage.url="], [], None, {}, "storage.url: is empty"),
    ("gs-url", ["storage.url=gs://bucket/x"], [], None, {}, "storage.url: scheme 'gs' is not supported"),
    ("secret-endpoint", ["storage.endpoint_url=http://key:s3cr3t@127.0.0.1:8333"], [], None, {}, "storage.endpoint_url: carries credentials"),
    ("secret-url", ["storage.url=s3://key:s3cr3t@bucket/x"], [], None, {}, "storage.url: carries credentials"),
    ("secret-mlflow", ["tracking.backends=[mlflow]", "tracking.mlflow.uri=http://me:s3cr3t@127.0.0.1:5000"], [], None, {},
     "tracking.mlflow.uri: carries credentials"),
    ("mlflow-unreachable", ["tracking.backends=[mlflow]", "tracking.mlflow.uri=http://127.0.0.1:9"], [], None, {},
     "tracking.mlflow.uri: no MLflow server answers at http://127.0.0.1:9 ("),
    ("tracker-twice", ["tracking.backends=[wandb, wandb]"], [], None, {}, "tracking.backends: names a backend twice"),
    ("trackio-project", ["tracking.trackio.project=.."], [], None, {}, "tracking.trackio.project: string should match pattern"),
    ("wandb-project", ["tracking.wandb.project=a/b"], [], None, {}, "tracking.wandb.project: string should match pattern"),
    ("wandb-mode", ["tracking.wandb.mode=dryrun"], [], None, {}, "tracking.wandb.mode: must be one of 'offline' or 'online'"),
    ("mlflow-scheme", ["tracking.mlflow.uri=file:///tmp/mlruns"], [], None, {}, "tracking.mlflow.uri: must look like http(s)://host"),
    ("name-traversal", ["run.name=../escape"], [], None, {}, "run.name: invalid run name '../escape'"),
    ("name-newline", ['run.name="abc\\n"'], [], None, {}, "run.name: invalid run name 'abc\\n'"),
    ("name-absolute", ["run.name=/abs"], [], None, {}, "run.name: invalid run name '/abs'"),
    ("name-empty", ['run.name=""'], [], None, {}, "run.name: invalid run name ''"),
    # local files the run would open
    ("model-missing", ["model.name=./no/such/model"], [], None, {}, "model.name: local path './no/such/model' does not exist"),
    ("prefs-missing", [*PAIRS_OFF, "data.prefs_path=/no/such/prefs.jsonl"], [], None, {}, "data.prefs_path: file not found"),
    ("prefs-suffix", [*PAIRS_OFF, "data.prefs_path={prefs.csv}"], [], None, {"prefs.csv": "prompt,chosen\n"}, "has an unsupported suffix"),
    # data files, row by row
    ("utf8", [*PAIRS_OFF, "data.prefs_path={p.jsonl}"], [], None, {"p.jsonl": LINE.encode() + b"\xff\xfe{}\n"}, "p.jsonl line 2: not valid UTF-8"),
    ("deep-json", [*PAIRS_OFF, "data.prefs_path={p.jsonl}"], [], None, {"p.jsonl": '{"prompt": ' + "[" * 100000 + "]" * 100000 + "}\n"}, "p.jsonl line 1: not valid JSON (nested too deeply)"),
    ("bad-json", [*PAIRS_OFF, "data.prefs_path={p.jsonl}"], [], None, {"p.jsonl": LINE + "{oops\n"}, "p.jsonl line 2: not valid JSON"),
    ("bad-json-drop-all", [*PAIRS_OFF, "data.on_bad_row=drop", "data.prefs_path={p.jsonl}"], [], None, {"p.jsonl": "{oops\n[1,\n"}, "no usable rows for prefs data (2 dropped)"),
    ("fake-parquet", [*PAIRS_OFF, "data.prefs_path={p.parquet}"], [], None, {"p.parquet": "PAR1 not really"}, "p.parquet: not a readable Parquet file"),
    ("cut-parquet", [*PAIRS_OFF, "data.prefs_path={cut.parquet}"], [], None, {"cut.parquet": truncated_parquet}, "cut.parquet: not a readable Parquet file"),
    ("int-content", [*PAIRS_OFF, "data.prefs_path={p.jsonl}"], [], None,
     {"p.jsonl": json.dumps({"chosen": [{"role": "user", "content": 5}], "rejected": "b"}) + "\n"}, "'chosen' message 0 content must be a string, got int"),
    ("same-answers", [*PAIRS_OFF, "data.prefs_path={p.jsonl}"], [], None, {"p.jsonl": '{"prompt": "p", "chosen": "a", "rejected": "a"}\n'}, "'chosen' and 'rejected' are identical"),
    ("implicit-without-prompt", [*PAIRS_OFF, "data.prefs_path={p.jsonl}", "reward_model.kind=implicit"], [], None,
     {"p.jsonl": '{"chosen": "a b", "rejected": "a c"}\n'}, "reward_model.kind: implicit scores an answer by its likelihood after the prompt"),
    ("prompts-role", ["data.prompts_path={q.jsonl}"], [], None,
     {"q.jsonl": '{"prompt": [{"role": "h4x0r", "content": "hi"}], "answer": "1"}\n'}, "q.jsonl line 1: 'prompt' message 0 has role 'h4x0r'"),
    ("surrogate", [*PAIRS_OFF, "data.prefs_path={p.jsonl}"], [], None, {"p.jsonl": '{"prompt": "\\ud800", "chosen": "a", "rejected": "b"}\n'}, "p.jsonl line 1: not valid Unicode text"),
    ("surrogate-config", ['storage.url="\\ud800"'], [], None, {}, "not valid Unicode text"),
    ("json-flag", [*PAIRS_OFF, "data.prefs_path={p.jsonl}"], ["--json"], None, {"p.jsonl": "{oops\n"}, "p.jsonl line 1: not valid JSON"),
    # config files
    ("bomb", [], [], laughs(10), {}, "through aliases; at most 100000"),
    ("bomb-set", ["sft.job_variables=[&a [1,1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], "
                  "&d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]]"], [], None, {}, "expands to 123456 nodes"),
    ("duplicate-keys", [], [], "run: {name: a}\nrun: {name: b}\n", {}, "duplicate key 'run'"),
    ("deep-yaml", [], [], "sft: {job_variables: " + "{a: " * 200 + "1" + "}" * 200 + "}\n", {}, "nested deeper than"),
    ("not-a-mapping", [], [], "- sft\n- dpo\n", {}, "top level must be a mapping of sections"),
    ("yaml-syntax", [], [], "sft: [unclosed\n", {}, "not valid YAML"),
    ("yaml-utf8", [], [], b"run: {name: \xff}\n", {}, "not valid YAML"),
    ("profiles-int", [], ["--profile", "tiny"], "run: {name: a}\nprofiles: {tiny: 5}\n", {}, "profiles.tiny: must be a mapping of overrides"),
    ("profiles-list", [], ["--profile", "tiny"], "run: {name: a}\nprofiles: [tiny]\n", {}, "profiles: must be a mapping of profile names"),
    ("unknown-profile", [], ["--profile", "huge"], None, {}, "profile: unknown profile 'huge'; available: default, tiny"),
    ("config-missing", [], ["-c", "/no/such/pipeline.yaml"], None, {}, "/no/such/pipeline.yaml: invalid configuration"),
    ("set-syntax", ["sft.learning_rate"], [], None, {}, "expected key.path=value"),
    ("set-into-value", ["grpo.learning_rate.x=1"], [], None, {}, "grpo.learning_rate: is a value, not a section"),
    # task parameters the reasoning-gym generator refuses (the default's are chain_sum's), also in a plan of SFT alone
    ("task-params", ["data.task=reasoning_gym:tower_of_hanoi"], [], None, {},
     "data.task_params: reasoning-gym's 'tower_of_hanoi' refuses {'min_terms': 2"),
    ("task-params-sft", ["data.task_params={min_terms: 0}", *[f"{s}.enabled=false" for s in
                         ("preferences", "reward_model", "ref_logprobs", "dpo", "grpo", "eval")]], [], None, {},
     "data.task_params: reasoning-gym's 'chain_sum' refuses {'min_terms': 0} (AssertionError"),
    # a built-in environment that cannot play the prompts (the hanoi game on chain_sum sums)
    ("env-prompts", ["grpo.environment={name: hanoi}"], [], None, {},
     "grpo.environment: environment 'hanoi' cannot play these prompts: prompt rl-0: the hanoi environment needs"),
    ("eval-env-prompts", ["eval.environment={name: hanoi}"], [], None, {},
     "eval.environment: environment 'hanoi' cannot play these prompts: prompt eval-0"),
]


RUNS = [(c, cmd) for c in CASES for cmd in ("validate", "run") if not (cmd == "run" and "--json" in c[2])]  # --json: validate's


@pytest.mark.parametrize("case, command", RUNS, ids=[f"{c[0]}-{cmd}" for c, cmd in RUNS])
def test_bad_input_exits_2_naming_what_is_wrong(tmp_path, monkeypatch, case, command):
    name, overrides, extra, config_text, files, expected = case
    # a tripwire, not a mock: a case that stops being refused must fail here, not run the default pipeline
    monkeypatch.setattr(flows.rlhf_flow, "execute_stage", lambda cfg, stage, *a: pytest.fail(f"{name} reached stage {stage}"))
    data = {n: (c(tmp_path) if callable(c) else write(tmp_path, n, c)) for n, c in files.items()}
    store = tmp_path / "store"
    args = [command]
    if config_text is not None:
        args += ["-c", write(tmp_path, "bad.yaml", config_text)]
    elif "-c" not in extra:
        args += ["-c", str(CONFIG)]
    for o in overrides:
        for n, path in data.items():
            o = o.replace("{" + n + "}", path)
        args += ["--set", o]
    if not any(o.startswith("storage.url") for o in overrides):
        args += ["--set", f"storage.url={store}"]
    result = CliRunner().invoke(app, args + extra)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.output and "s3cr3t" not in result.output
    assert not store.exists()  # nothing written, not even a lock or an attempt record


NODES = ["--set", "sft.launch.processes=2", "--set", "sft.launch.nnodes=2", "--set", "sft.launch.rendezvous=127.0.0.1:29500"]


@pytest.mark.parametrize("args, expected", [
    (["--stage", "sft\x1b[2J\n", "--node-rank", "1"], "--stage: 'sft\\x1b[2J\\n' is not a stage; one of sft, preferences"),
    (["--stage", "../sft", "--node-rank", "1"], "--stage: '../sft' is not a stage"),
    (["--stage", "sft", "--node-rank", "1"], "sft.launch.nnodes: `rlhf join` is for a stage launched on several nodes"),
    (["--stage", "eval", "--node-rank", "1"], "eval.launch.nnodes: `rlhf join` is for a stage launched on several nodes"),
    (["--stage", "sft", "--node-rank", "0", *NODES], "--node-rank: must be 1 .. 1 (node 0 is the stage's worker), got 0"),
    (["--stage", "sft", "--node-rank", "-5", *NODES], "--node-rank: must be 1 .. 1"),
    (["--stage", "sft", "--node-rank", "99999999999999999999", *NODES], "--node-rank: must be 1 .. 1"),
    (["--stage", "sft", "--node-rank", "one", *NODES], "Invalid value for '--node-rank': Input should be a valid integer"),
])
def test_join_refuses_bad_arguments_before_anything_runs(tmp_path, args, expected):
    store = tmp_path / "store"
    result = CliRunner().invoke(app, ["join", "--profile", "tiny", "--set", f"storage.url={store}", *args])
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.output and "\x1b" not in result.output
    assert not store.exists()


def test_the_installed_command_exits_2_on_a_bad_value():
    """The same path through the console script a user runs (the table runs in-process)."""
    proc = run_cli("validate", "--set", "grpo.max_kl=.inf")
    assert proc.returncode == 2 and "grpo.max_kl: input should be a finite number" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_installed_command_names_a_size_the_task_cannot_fill():
    """Valid values each, but 384 training problems of a 200-question task leave too few new held-out questions."""
    proc = run_cli("validate", "--set", "data.task_params={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}")
    assert proc.returncode == 2, proc.stderr
    assert re.search(r"^data.eval_size: 512 asked, but only \d+ of the 4096 problems that reasoning_gym:chain_sum generated "
                     r"for it are new questions", proc.stderr, re.M), proc.stderr
    assert "Traceback" not in proc.stderr


SECTIONS = {
    "run": ["seed", "name"], "data": ["train_size", "eval_size", "seed", "task", "on_bad_row"],
    "sft": ["learning_rate", "per_device_batch_size", "num_epochs", "max_steps", "max_length", "lora"],
    "grpo": ["group_size", "minibatch_size", "beta", "max_kl", "iterations", "logp_old"],
    "dpo": ["beta", "loss_type", "max_length", "nll_weight"], "eval": ["prompts", "policies", "anchor"],
    "storage": ["url", "attempts", "backoff_seconds"], "rollout": ["temperature", "top_p", "engine"],
    "preferences": ["samples_per_prompt", "pairing", "judge"],
}
values = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40), st.lists(st.integers(-5, 5), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
keys = st.sampled_from([f"{s}.{k}" for s, ks in SECTIONS.items() for k in ks] + ["sft.nope", "nope.x", "grpo.lora.r"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(assignments=st.lists(st.tuples(keys, values), min_size=1, max_size=3))
def test_fuzzed_config_values_give_exit_0_or_a_key_path(tmp_path, assignments):
    """Whatever the values: exit 0, or exit 2 with 'key.path: problem' lines; never a traceback."""
    args = ["validate", "-c", str(CONFIG), "--profile", "tiny", "--set", f"storage.url={tmp_path / 'store'}"]
    for key, value in assignments:
        args += ["--set", f"{key}={json.dumps(value)}"]  # JSON is YAML: the value arrives typed as generated
    result = CliRunner().invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in (0, 2), result.output
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        lines = [line.strip() for line in result.stderr.splitlines()[1:] if line.strip()]
        sections = set(PipelineConfig.model_fields) | {"nope"}  # each line starts with the key path: section.key...: problem
        assert lines and all(": " in line and re.split(r"[.:]", line)[0] in sections for line in lines), result.stderr
