"""Typed, frozen configuration for every stage, loaded from pipeline.yaml.

One model per stage; unknown keys are errors (extra="forbid"); enums are Literal types; cross-field
checks run at load time and name the key path. Defaults follow the papers cited beside each field.
Nothing here imports torch or loads a model: `rlhf validate` must answer in about a second.
"""

from __future__ import annotations

import re
import typing
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator


class ConfigError(Exception):
    """Bad configuration; `problems` are 'key.path: what is wrong' lines. The CLI exits 2 on it."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: invalid configuration\n" + "\n".join(f"  {p}" for p in problems))


SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # used with fullmatch: no trailing newline slips by


def check_name(kind: str, value: str) -> str:
    """Run and stage names become storage path segments: refuse traversal and odd characters."""
    if not isinstance(value, str) or not SAFE_NAME.fullmatch(value) or ".." in value:
        raise ValueError(
            f"invalid {kind} name {value!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, and no '..'"
        )
    return value


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # no .inf / .nan anywhere

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, v, info):
        # pydantic's lax mode reads `true` as 1 for an int field: `per_device_batch_size: true` would train
        # with batch 1. YAML booleans are only accepted where the field itself is a boolean.
        if isinstance(v, bool):
            annotation = cls.model_fields[info.field_name].annotation
            if annotation in (int, float) or {int, float} & set(typing.get_args(annotation)) and bool not in typing.get_args(annotation):
                raise ValueError(f"must be a number, got {str(v).lower()}")
        return v


class RunConfig(Strict):
    name: str = "default"  # artifacts go to <storage.url>/<name>/<stage>/; one live run per name
    seed: int = Field(0, ge=0, lt=2**32)  # training seed (Trainer seed, RL sampling)
    work_pool: str = "cpu"  # where the orchestrating `rlhf/full` flow run itself goes (it only waits)
    stage_work_pool: str = "gpu"  # where every stage runs unless its own work_pool says otherwise

    @field_validator("name")
    @classmethod
    def _safe(cls, v: str) -> str:
        return check_name("run", v)


class TinyModelConfig(Strict):
    """A random-init Llama with the default tokenizer: same code paths as the real model, in seconds."""

    hidden_size: int = Field(64, ge=8)  # width of the random-init test model
    num_layers: int = Field(2, ge=1)  # decoder layers
    num_heads: int = Field(4, ge=1)  # attention heads (must divide hidden_size)
    num_kv_heads: int = Field(2, ge=1)  # key/value heads, grouped-query attention
    intermediate_size: int = Field(128, ge=8)  # MLP width
    init_seed: int = Field(0, ge=0, lt=2**32)  # seed of the random initialisation

    @model_validator(mode="after")
    def _heads(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size: must be divisible by num_heads ({self.num_heads}), got {self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads: must be divisible by num_kv_heads ({self.num_kv_heads}), got {self.num_heads}")
        return self


class ModelConfig(Strict):
    # "smollm2-135m-instruct" (embedded, offline), "tiny" (random init), a Hugging Face id or a local path.
    name: str = "smollm2-135m-instruct"
    # weights and compute dtype; bfloat16 needs a GPU or a CPU with AVX512_BF16 or AMX, float16 a GPU
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] = "sdpa"  # transformers attention kernel
    # Mixed precision (Micikevicius et al. 2018): trained weights, gradients and AdamW states in float32,
    # compute in `dtype` (autocast); frozen models (reference, reward model) and LoRA bases stay in `dtype`.
    # auto (with dtype float32): true with dtype bfloat16 where the hardware computes bfloat16 natively (a GPU
    # that supports it, a CPU with AVX512_BF16 or AMX), else false; decided by the machine that reads the config
    # (`rlhf run`'s, a deployment's flow run), so the keys and every stage see one choice. Stages on other
    # hardware than that (a GPU pool under a CPU flow run): set true or false.
    mixed_precision: Literal[False, True, "auto"] = False
    # dtype of the stages that only run inference (preferences sampling, the reference cache, rollout, eval);
    # unset: `dtype`; auto: bfloat16 where the hardware computes it natively (a GPU that supports it, a CPU
    # with AVX512_BF16 or AMX), else `dtype`. Trained and RL stages never read it.
    inference_dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    tiny: TinyModelConfig = TinyModelConfig()

    @field_validator("name")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v

    @model_validator(mode="before")
    @classmethod
    def _auto_precision(cls, data):
        if isinstance(data, dict) and data.get("mixed_precision") == "auto":
            if data.get("dtype", "float32") != "float32":
                raise ValueError("mixed_precision: auto goes with dtype float32 (it chooses between float32 and "
                                 "bfloat16 mixed precision); with another dtype set it to true or false")
            from rlhf.core import hardware

            native = hardware.native_bf16()
            data = {**data, "dtype": "bfloat16" if native else "float32", "mixed_precision": native}
        return data

    @model_validator(mode="after")
    def _mixed(self) -> ModelConfig:
        if self.mixed_precision and self.dtype == "float32":
            raise ValueError("mixed_precision: needs a 16-bit compute dtype (bfloat16 or float16), got dtype float32")
        return self


class DataConfig(Strict):
    # reasoning_gym:<dataset name>; generator parameters pass through unchanged to reasoning-gym.
    task: str = "reasoning_gym:chain_sum"
    # the reasoning-gym generator's parameters
    task_params: dict[str, int | float | bool | str] = Field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    )
    seed: int = Field(0, ge=0, lt=2**31)  # seed of the generated problems and of KTO's example order
    # Every process that reads the prompts holds them (~1.4 KB a generated problem, ~26 s a million to
    # generate on one core), validate included: hence the bounds.
    train_size: int = Field(1000, ge=1, le=1_000_000)  # training problems (SFT demonstrations, preference pairs, RL prompts)
    eval_size: int = Field(100, ge=1, le=100_000)  # held-out problems, never trained on
    # RL prompts: 0 uses the training problems (whose gold answers SFT has seen); N > 0 draws N fresh
    # problems, disjoint from train and eval, as InstructGPT keeps separate SFT and PPO prompt sets
    rl_size: int = Field(0, ge=0, le=1_000_000)
    # User data in TRL's standard formats (JSONL, Parquet or a Hugging Face dataset name).
    # When set, it replaces the task's generated data for that use.
    sft_path: str | None = None
    prefs_path: str | None = None  # preference pairs {prompt, chosen, rejected} or {chosen, rejected}
    # KTO's unpaired examples {prompt, completion, label}; when unset, KTO unpairs the preference pairs
    unpaired_path: str | None = None
    # fail: stop at the first bad row, naming it; drop: skip bad rows and count them
    on_bad_row: Literal["fail", "drop"] = "fail"
    # SFT demonstrations: the bare answer (direct), or a worked solution that splits each step into tens
    # and units before the answer (worked; chain_sum only): room to reason before the answer; or a call to
    # the calculator tool on the expression, then its result (calculator; chain_sum only; for
    # grpo.environment: calculator)
    answer_format: Literal["direct", "worked", "calculator"] = "direct"
    # the system turn of every task prompt; null: the chat template's own (SmolLM2's is 16 tokens,
    # "You are a helpful AI assistant named SmolLM, trained by Hugging Face"); "": an empty one. Users' data
    # files keep their own conversations
    system_prompt: str | None = Field(None, max_length=10_000)
    # the verifier's score: 1 for full marks and 0 otherwise, the held-out accuracy's criterion; or (true)
    # reasoning-gym's own, which gives partial credit when the gold answer is a substring of the reply
    # ('-19' for -1 scores 0.67, '12' for 2 scores 0.5): that rewards wrong answers in RL and makes some
    # wrong answers "chosen" in on-policy pairs (docs/benchmarks.md). true reproduces runs before 2026-12-02
    partial_credit: bool = False
    # Your own prompts, instead of data.task's generated problems, for the preferences stage, PPO, GRPO,
    # rollouts and eval (JSONL, Parquet, a local Hugging Face dataset folder, or a hub dataset name): rows
    # {prompt: str | [messages], ...any other columns}; every other column reaches reward functions by name
    prompts_path: str | None = None
    eval_prompts_path: str | None = None  # held-out prompts; unset: a seeded split of prompts_path
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0)  # the held-out share of that split (by data.seed)
    # the column with each prompt's gold answer, for the verifier (RL rewards, pairs, eval accuracy);
    # null: open-ended prompts, judged by the reward model
    answer_column: str | None = Field("answer", min_length=1, max_length=100)
    # how a completion is checked against the answer: math_verify (HF's math-verify: the last answer in the
    # completion, as a number, fraction, decimal, LaTeX or \boxed{}, equal in value), or exact (the stripped
    # completion equals the stripped answer)
    verifier: Literal["math_verify", "exact"] = "math_verify"
    # SFT demonstrations from the prompts file when data.sft_path is unset: this column as the reply
    # (a worked solution); null: the answer column
    completion_column: str | None = Field(None, min_length=1, max_length=100)

    @field_validator("task")
    @classmethod
    def _task(cls, v: str) -> str:
        if not re.fullmatch(r"reasoning_gym:[a-z0-9_]+", v):
            raise ValueError("must look like 'reasoning_gym:<name>', e.g. 'reasoning_gym:chain_sum'")
        return v

    @model_validator(mode="after")
    def _format(self) -> DataConfig:
        if self.answer_format != "direct" and (self.task != "reasoning_gym:chain_sum" or self.prompts_path):
            raise ValueError(f"answer_format: {self.answer_format!r} solutions exist for reasoning_gym:chain_sum only, "
                             f"got task {self.task!r}")
        if self.eval_prompts_path and not self.prompts_path:
            raise ValueError("eval_prompts_path: held-out prompts go with data.prompts_path (the training prompts)")
        if self.completion_column and not self.prompts_path:
            raise ValueError("completion_column: names a column of data.prompts_path, which is unset")
        return self

    def open_ended(self) -> bool:
        """Prompts without gold answers: nothing to verify, the reward model judges."""
        return bool(self.prompts_path) and self.answer_column is None


class MlflowOptions(Strict):
    """The MLflow tracking server (tracking.backends: [mlflow]); the client is mlflow-skinny."""

    # `rlhf up` starts a server here (SQLite backend, 127.0.0.1 only) when the host is 127.0.0.1 or
    # localhost; any other URL is a server of yours. Credentials come from MLFLOW_TRACKING_USERNAME /
    # MLFLOW_TRACKING_PASSWORD in the environment, never from here.
    uri: str = "http://127.0.0.1:5000"
    experiment: str = Field("rlhf", min_length=1, max_length=200, pattern=r"^[A-Za-z0-9 ._/-]+$")  # MLflow experiment
    # the server's interpreter (full mlflow, its own environment: ./setup-mlflow.sh); default
    # RLHF_MLFLOW_PYTHON, else .venv-mlflow/bin/python
    server_python: str | None = None

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        m = re.fullmatch(r"(https?)://([^/?#\s]+)(/[^?#\s]*)?", v)
        if not m:
            raise ValueError("must look like http(s)://host[:port][/path]")
        if "@" in m.group(2):  # refused, not redacted: it would reach manifests and logs (not echoed back)
            raise ValueError("carries credentials (user:password@); give them as MLFLOW_TRACKING_USERNAME / "
                             "MLFLOW_TRACKING_PASSWORD in the environment instead")
        return v.rstrip("/")


NAME = r"^[A-Za-z0-9_-][A-Za-z0-9._-]*$"  # a tracker's project or entity: no path, no leading dot


class TrackioOptions(Strict):
    """trackio (tracking.backends: [trackio]): local SQLite in trackio's own folder (TRACKIO_DIR, default
    $HF_HOME/trackio); `trackio show` opens its dashboard. Nothing leaves the machine."""

    # trackio project; its runs are named <run>.<stage>.<key prefix> and grouped by the pipeline run
    project: str = Field("rlhf", min_length=1, max_length=100, pattern=NAME)


class WandbOptions(Strict):
    """Weights & Biases (tracking.backends: [wandb]). Offline by default: run files go to <stage>/wandb/ in
    the store (`wandb sync <folder>` uploads them later); online needs WANDB_API_KEY (or `wandb login`)
    and a reachable WANDB_BASE_URL (default https://api.wandb.ai), checked before any work."""

    # offline: files only (synced later with `wandb sync`); online: logs to the W&B server as it trains
    mode: Literal["offline", "online"] = "offline"
    project: str = Field("rlhf", min_length=1, max_length=128, pattern=NAME)  # W&B project
    entity: str | None = Field(None, min_length=1, max_length=128, pattern=NAME)  # team or user


class TrackingConfig(Strict):
    # Experiment trackers that also receive params, per-step and final metrics (the store keeps them anyway):
    # tensorboard writes event files to <stage>/tensorboard/ in the store; mlflow logs to tracking.mlflow.uri,
    # one run per pipeline run with a nested run per stage; trackio and wandb log a run per stage grouped by
    # the pipeline run (wandb's offline files go to <stage>/wandb/). Not part of any content key.
    backends: list[Literal["tensorboard", "mlflow", "trackio", "wandb"]] = Field(default_factory=list)
    mlflow: MlflowOptions = MlflowOptions()
    trackio: TrackioOptions = TrackioOptions()
    wandb: WandbOptions = WandbOptions()

    @field_validator("backends")
    @classmethod
    def _once(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"names a backend twice: {v}")
        return v


class StorageConfig(Strict):
    # A local folder (relative paths are resolved against pipeline.yaml's folder) or s3://bucket/prefix.
    # S3 credentials come from the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), never from here.
    url: str = "data/artifacts"
    endpoint_url: str | None = None  # S3-compatible endpoint (SeaweedFS, MinIO); else AWS_ENDPOINT_URL
    region: str = "us-west-1"  # S3 region
    # Transient storage errors (connection refused/reset, timeouts) are retried with exponential
    # backoff this many times in total, then the operation fails naming the URL.
    attempts: int = Field(4, ge=1, le=100)
    backoff_seconds: float = Field(0.5, ge=0.0, le=3600.0)  # first retry delay; doubles each attempt

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        # Refused rather than redacted: a secret in the config would reach manifests, eval's `run` table,
        # logs and Prefect's flow parameters. The value is not echoed back.
        if v is None:
            return v
        m = re.fullmatch(r"(https?)://([^/?#\s]+)(/[^\s]*)?", v)
        if not m:
            raise ValueError("must look like http(s)://host[:port]")
        if "@" in m.group(2):
            raise ValueError("carries credentials (user:password@); give them as AWS_ACCESS_KEY_ID / "
                             "AWS_SECRET_ACCESS_KEY in the environment instead")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("is empty; give a local folder or s3://bucket/prefix")
        if re.match(r"[A-Za-z0-9+.-]+://[^/]*@", v):
            raise ValueError("carries credentials; give them through the environment (AWS_*) instead")
        scheme = v.split("://", 1)[0] if "://" in v else "file"
        if scheme not in ("file", "s3"):
            raise ValueError(f"scheme {scheme!r} is not supported; use a local path, file:// or s3://")
        if scheme == "s3" and not re.fullmatch(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?", v):
            raise ValueError("must look like s3://bucket/optional/prefix with a valid bucket name")
        return v


JobVariables = dict[str, str | int | float | bool | list | dict | None]


class Placement(Strict):
    """Where a stage runs: a Prefect work pool and job variables for it (e.g. image and GPU requests of
    a Kubernetes pool). Neither changes a stage's outputs, so neither is part of its content key."""

    enabled: bool = True  # run this stage in the pipeline
    work_pool: str | None = None  # Prefect work pool the stage runs on under `rlhf up` / `rlhf/full`; null: run.stage_work_pool
    # the pool's job variables, e.g. {image: ..., gpu: 1} for Kubernetes
    job_variables: JobVariables = Field(default_factory=dict)


class LoraConfig(Strict):
    enabled: bool = False  # train LoRA adapters (Hu et al. 2021) instead of all weights; merged when published
    r: int = Field(16, ge=1)  # adapter rank
    alpha: int = Field(32, ge=1)  # adapter scale numerator (scale = alpha / r)
    dropout: float = Field(0.05, ge=0.0, lt=1.0)  # dropout on the adapter input
    target_modules: str | list[str] = "all-linear"  # 'all-linear' or module names


HOST_PORT = r"^[A-Za-z0-9.-]+:[0-9]{1,5}$"  # host:port, no scheme, user or path


def host_port(v: str | None) -> str | None:
    """A host:port whose port is a TCP port (the pattern has checked the shape)."""
    if v is not None and not 0 < int(v.rsplit(":", 1)[1]) < 65536:
        raise ValueError(f"port must be 1-65535, got {v.rsplit(':', 1)[1]}")
    return v


class RayLaunch(Strict):
    """Where a stage's ranks go on a Ray cluster (launch.backend: ray): one placement group of
    `processes` bundles. Not part of the content key: where ranks run does not change what they compute."""

    # host:port of the cluster's head (GCS); null: RAY_ADDRESS from the environment
    address: str | None = Field(None, pattern=HOST_PORT, max_length=255)
    # PACK: few nodes; SPREAD: many; STRICT_SPREAD: one rank per node (Ray's placement strategies)
    strategy: Literal["PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    cpus_per_rank: float = Field(1.0, gt=0.0, le=1024.0)  # CPUs reserved in each bundle (and torch threads per rank)
    gpus_per_rank: int = Field(0, ge=0, le=1)  # GPUs reserved in each bundle: 0 (CPU ranks) or 1 (a rank drives one GPU)
    ready_seconds: float = Field(60.0, gt=0.0, le=86_400.0)  # how long to wait for the cluster to place the bundles
    # RL stages (ppo, grpo): the rollout engine inside every rank (colocated), or one engine actor on a
    # bundle of its own in the same placement group (own), whose weights follow the policy after each update
    engine: Literal["colocated", "own"] = "colocated"
    engine_cpus: float = Field(1.0, gt=0.0, le=1024.0)  # CPUs of the engine's bundle (engine: own)
    engine_gpus: int = Field(0, ge=0, le=1)  # GPUs of the engine's bundle (engine: own)
    # RL stages: the frozen scorers (reference, reward model) inside every rank (colocated), or one actor
    # holding them on a bundle of its own (own); the ranks send it their rows to score
    scorers: Literal["colocated", "own"] = "colocated"
    scorer_cpus: float = Field(1.0, gt=0.0, le=1024.0)  # CPUs of the scorers' bundle (scorers: own)
    scorer_gpus: int = Field(0, ge=0, le=1)  # GPUs of the scorers' bundle (scorers: own)

    @field_validator("address")
    @classmethod
    def _port(cls, v: str | None) -> str | None:
        return host_port(v)


class LaunchConfig(Strict):
    """Processes of one stage: torchrun on this node, or ranks on a Ray cluster. The world size changes the
    global batch (per_device_batch_size x processes x gradient_accumulation_steps), so it is part of the
    content key; the backend and its placement are not."""

    processes: int = Field(1, ge=1)  # data-parallel processes; gloo on CPU, nccl on GPUs
    # ddp: replicated weights; fsdp: fully sharded (GPUs); deepspeed_zero3: DeepSpeed ZeRO-3 (GPUs, deepspeed installed)
    strategy: Literal["ddp", "fsdp", "deepspeed_zero3"] = "ddp"
    # torchrun: processes on the worker that runs the stage; ray: ranks in a placement group of a Ray cluster
    backend: Literal["torchrun", "ray"] = "torchrun"
    ray: RayLaunch = RayLaunch()
    # torchrun across machines: the `processes` ranks split evenly over nnodes nodes; the stage's worker is
    # node 0, each other node joins with `rlhf join --stage <stage> --node-rank K` (same config)
    nnodes: int = Field(1, ge=1, le=1024)
    # host:port where node 0 takes the ranks' rendezvous (torchrun's master address and port); nnodes > 1
    rendezvous: str | None = Field(None, pattern=HOST_PORT, max_length=255)

    @field_validator("rendezvous")
    @classmethod
    def _port(cls, v: str | None) -> str | None:
        return host_port(v)

    @model_validator(mode="after")
    def _nodes(self) -> LaunchConfig:
        for what, value in (("engine", self.ray.engine), ("scorers", self.ray.scorers)):
            if value == "own" and self.backend != "ray":
                raise ValueError(f"backend: ray.{what} 'own' places an actor in the stage's Ray placement group, "
                                 f"so it needs backend 'ray', got {self.backend!r}")
        if self.nnodes > 1:
            if self.backend != "torchrun":
                raise ValueError(f"nnodes: {self.nnodes} nodes is a torchrun setting; Ray places ranks itself (backend ray)")
            if self.processes % self.nnodes:
                raise ValueError(f"nnodes: processes ({self.processes}) must split evenly over {self.nnodes} nodes")
            if self.rendezvous is None:
                raise ValueError(f"rendezvous: {self.nnodes} nodes need node 0's host:port")
        return self


class TrainerOptions(Placement):
    """Options shared by the Trainer-based stages (SFT, reward model, DPO)."""

    learning_rate: float = Field(2e-5, gt=0.0, lt=1.0)  # peak learning rate (AdamW)
    num_epochs: float = Field(1.0, gt=0.0, le=10_000.0)  # passes over the training rows (when max_steps is -1)
    max_steps: int = Field(-1, ge=-1, le=100_000_000)  # -1: derived from num_epochs
    per_device_batch_size: int = Field(8, ge=1)  # rows per forward pass per device
    gradient_accumulation_steps: int = Field(1, ge=1)  # forward passes per optimizer step
    max_length: int = Field(256, ge=8)  # prompt + completion tokens; longer rows are reported (fail/drop)
    # adamw_torch_fused: adamw_torch's update in one kernel per step (torch's fused=True: 0.07 s against
    # 0.37 s a step for 135M weights on 2 CPU cores); adamw_bnb_8bit: 8-bit AdamW states (bitsandbytes)
    optim: Literal["adamw_torch_fused", "adamw_torch", "adamw_bnb_8bit"] = "adamw_torch_fused"
    # learning-rate schedule after warmup
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0)  # share of the steps with linear warmup
    weight_decay: float = Field(0.0, ge=0.0)  # AdamW decoupled weight decay
    max_grad_norm: float = Field(1.0, gt=0.0)  # gradient clipping by global norm
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~30% slower
    save_steps: int = Field(50, ge=1)  # checkpoint (mirrored to the store) every N optimizer steps
    logging_steps: int = Field(5, ge=1)  # metrics row and progress line every N steps
    lora: LoraConfig = LoraConfig()
    launch: LaunchConfig = LaunchConfig()  # several processes for this stage (rlhf/pipeline/launch.py)

    @model_validator(mode="after")
    def _steps(self) -> TrainerOptions:
        if "own" in (self.launch.ray.engine, self.launch.ray.scorers):
            raise ValueError("launch: ray.engine and ray.scorers 'own' are for the RL stages (ppo, grpo), which "
                             "sample through a rollout engine and score with frozen models; leave them 'colocated' here")
        if self.max_steps == 0:
            raise ValueError("max_steps: must be -1 (use num_epochs) or >= 1, got 0")
        return self


class SFTConfig(TrainerOptions):
    learning_rate: float = Field(5e-5, gt=0.0, lt=1.0)  # peak learning rate (AdamW)
    completion_only_loss: bool = True  # loss on completion tokens only (InstructGPT, Ouyang et al. 2022)
    # Held-out greedy accuracy of the base and the trained policy, measured at the end of the stage.
    eval_prompts: int = Field(64, ge=0)
    eval_max_new_tokens: int = Field(16, ge=1)  # generation budget of those answers


class RewardModelConfig(TrainerOptions):
    learning_rate: float = Field(1e-5, gt=0.0, lt=1.0)  # peak learning rate (AdamW)
    init_from: Literal["sft", "base"] = "sft"  # backbone: the SFT model or the base model
    # classifier: a scalar head on the last token (InstructGPT). implicit: the reward is the fine-tuned LM's own
    # summed log-likelihood of the answer, r(x, y) = log pi(y | x), fit with the same Bradley-Terry loss
    # (Rafailov et al. 2023 sec. 5, reference-free): it keeps the LM head, and with it what SFT learnt.
    # auto: implicit for pairs of the pipeline's own answers (preferences stage, the task's pairs), classifier
    # for a data.prefs_path file; resolved when the config loads, so manifests and keys carry the kind.
    kind: Literal["auto", "classifier", "implicit"] = "auto"
    # Held-out share of the preference pairs for pairwise accuracy.
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    # Bradley-Terry with margin (Llama 2, Touvron et al. 2023, eq. 2) when pairs carry a `margin` column.
    use_margin: bool = False
    # Auxiliary loss pushing rewards toward zero mean (Eisenstein et al. 2023); 0 disables it.
    center_rewards_coefficient: float = Field(0.0, ge=0.0)

    @model_validator(mode="after")
    def _implicit(self) -> RewardModelConfig:
        for key in ("use_margin", "center_rewards_coefficient"):
            if self.kind == "implicit" and getattr(self, key):
                raise ValueError(f"{key}: a classifier option (TRL's RewardTrainer); kind 'implicit' trains without it")
        return self


USER_PAIRS_KIND = "classifier"


def auto_reward_model_kind(user_pairs: bool, options: dict) -> str:
    """reward_model.kind: auto. Pairs of the policy's own answers to verifiable prompts (the preferences
    stage, or the task's synthetic pairs) get `implicit`: on chain_sum it reached 0.858 held-out against the
    classifier's 0.613 on the same pairs. Pairs from a user's file get USER_PAIRS_KIND, the kind that read
    human-written pairs best (HH-RLHF, docs/benchmarks.md); the classifier's own options ask for it."""
    if options.get("use_margin") or options.get("center_rewards_coefficient"):
        return "classifier"
    return USER_PAIRS_KIND if user_pairs else "implicit"


class RefLogprobsConfig(Placement):
    enabled: bool = False  # compute the reference log-prob cache (DPO needs it)
    batch_size: int = Field(16, ge=1)  # pairs per reference forward pass
    # Prompt + completion tokens, as DPO's collator truncates them: null follows dpo.max_length (the cached
    # numbers must see DPO's truncation); a value must equal it.
    max_length: int | None = Field(None, ge=8)
    per_token: bool = False  # also keep per-token log-probs (list columns)


class VLLMOptions(Strict):
    """The vLLM engine (rollout.engine: vllm), run from its own virtualenv (./setup-vllm.sh)."""

    python: str | None = None  # that environment's interpreter; default RLHF_VLLM_PYTHON, else .venv-vllm/bin/python
    tensor_parallel_size: int = Field(1, ge=1)  # GPUs one engine spans
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)  # share of GPU memory vLLM may take (weights + KV cache)
    max_model_len: int = Field(1024, ge=16)  # prompt + response tokens per sequence
    # no torch.compile / CUDA graphs: starts in seconds instead of minutes (CPU: about 90 s of compiling)
    enforce_eager: bool = False
    # RL weight sync check: max |log-prob difference| on a probe sequence between engine and trainer.
    # float32 on CPU measured 1e-6; 16-bit dtypes round differently in each engine: loosen it there.
    sync_tolerance: float = Field(1e-3, gt=0.0)


class AsyncRollout(Strict):
    """The RL stages sample the next iterations while the trainer updates (rlhf/train/async_rollout.py)."""

    # iteration j samples with the policy after update j - 1 - max_lag: 0 is the synchronous loop's samples,
    # 1 overlaps one iteration's sampling with the previous one's update (verl's one-step-off)
    max_lag: int = Field(1, ge=0, le=64)
    # CPU threads of the sampling thread's kernels (torch.set_num_threads is per thread); null: torch's
    # default, which on a CPU-only machine makes the two threads share every core
    threads: int | None = Field(None, ge=1, le=1024)


class RolloutConfig(Placement):
    """Sampling for the rollout stage and for the RL stages' experience generation."""

    # `async` (a Python keyword) is the field `async_`: dumps say `async`, so a dump validates again
    model_config = ConfigDict(**Placement.model_config, serialize_by_alias=True)

    enabled: bool = False  # run the rollout stage (the RL stages sample with these settings either way)
    policy: Literal["base", "sft", "dpo", "kto", "ppo", "grpo"] = "sft"  # the rollout stage's checkpoint
    split: Literal["train", "eval"] = "eval"  # which prompts the rollout stage answers
    prompts: int = Field(64, ge=1)  # prompts the rollout stage answers
    seed: int = Field(0, ge=0, lt=2**32)  # sampling seed: the same params and seed give the same samples
    engine: Literal["hf", "vllm"] = "hf"  # hf: transformers generate in this process; vllm: see rollout.vllm
    vllm: VLLMOptions = VLLMOptions()
    temperature: float = Field(1.0, ge=0.0)  # sampling temperature; 0 is greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)  # nucleus sampling
    max_new_tokens: int = Field(32, ge=1)  # response budget in tokens
    n: int = Field(1, ge=1)  # samples per prompt in the rollout stage
    batch_size: int = Field(16, ge=1)  # answers (prompt x sample) per generate call
    # PPO and GRPO sample on a thread of their own while the trainer updates; null: sample, then update
    async_: AsyncRollout | None = Field(None, alias="async")


class PreferencesConfig(Placement):
    """On-policy preference pairs: K sampled answers per prompt from the policy, judged, best vs worst.

    The reward model, the reference cache / DPO and KTO train on these pairs when this stage is enabled
    (and data.prefs_path is unset), as in InstructGPT (comparisons of the policy's own samples) and
    RLHFlow's iterative DPO. Held-out prompts give `eval_pairs`, on which the reward model is scored.
    """

    enabled: bool = False  # build pairs from the policy's own samples (else: data.prefs_path or the task's pairs)
    policy: Literal["base", "sft"] = "sft"  # whose samples are judged
    samples_per_prompt: int = Field(4, ge=2)  # K answers per prompt
    prompts: int | None = Field(None, ge=1)  # training prompts to sample (None: all of data.train_size)
    eval_prompts: int = Field(64, ge=0)  # held-out prompts whose pairs score the reward model (at most data.eval_size)
    temperature: float = Field(1.0, gt=0.0, le=10.0)  # sampling temperature (K > 1 needs diversity)
    top_p: float = Field(1.0, gt=0.0, le=1.0)  # nucleus sampling
    max_new_tokens: int = Field(16, ge=1, le=4096)  # answer budget in tokens
    batch_size: int = Field(32, ge=1)  # answers (prompt x sample) per generate call
    seed: int = Field(0, ge=0, lt=2**32)  # sampling seed
    # verifier: the task's check; function: `reward_function` ('module:function', TRL's signature);
    # reward_model: the reward model at `reward_model_path` (a local folder or hub id): a sequence classifier, or a
    # causal LM scored by its summed log-likelihood of the answer (reward_model.kind: implicit)
    judge: Literal["verifier", "function", "reward_model"] = "verifier"
    reward_function: str | None = None  # 'module:function' when judge is 'function'
    reward_model_path: str | None = None  # a reward model folder or hub id when judge is 'reward_model'
    # best_worst: one pair per prompt, the highest- vs the lowest-scored answer; all_pairs: every two
    # answers with different scores. Equal scores are ties: dropped and counted.
    pairing: Literal["best_worst", "all_pairs"] = "best_worst"
    # all_pairs: at most this many pairs per prompt (the first in sample order; None: every pair). More
    # distinct wrong answers per prompt teach the reward model more than one best-vs-worst pair does.
    max_pairs_per_prompt: int | None = Field(None, ge=1)
    # Base-model answers per training prompt (0: none). Each one the judge scores below one of the
    # policy's answers to the same prompt becomes a pair in contrast_pairs.parquet, which only the reward
    # model trains on: without them it never sees the base model's verbose answers, and its judge can
    # rate base above SFT (docs/benchmarks.md). Base answers are sampled as the policy's are.
    contrast_samples: int = Field(0, ge=0, le=64)

    @model_validator(mode="after")
    def _judge(self) -> PreferencesConfig:
        if (self.judge == "function") != (self.reward_function is not None):
            raise ValueError("reward_function: set it exactly when judge is 'function' ('module:function')")
        if (self.judge == "reward_model") != (self.reward_model_path is not None):
            raise ValueError("reward_model_path: set it exactly when judge is 'reward_model'")
        if self.max_pairs_per_prompt is not None and self.pairing != "all_pairs":
            raise ValueError("max_pairs_per_prompt: caps pairing 'all_pairs' (best_worst gives one pair per prompt)")
        if self.contrast_samples and self.policy == "base":
            raise ValueError("contrast_samples: contrasts the SFT policy's answers with the base model's; "
                             "policy is already 'base'")
        return self


class DPOConfig(TrainerOptions):
    enabled: bool = False  # run DPO (needs ref_logprobs)
    learning_rate: float = Field(5e-7, gt=0.0, lt=1.0)  # peak learning rate (AdamW)
    # sigmoid: DPO; ipo: Azar et al. 2023; robust: rDPO, Chowdhury et al. 2024
    loss_type: Literal["sigmoid", "ipo", "robust"] = "sigmoid"
    beta: float = Field(0.1, gt=0.0)  # Rafailov et al. 2023 use 0.1
    # Preference-flip rate for loss_type 'robust' (rDPO, Chowdhury et al. 2024). TRL 1.16's 'sigmoid'
    # ignores label smoothing, so accepting it there would silently do nothing.
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)
    # alpha of an NLL term on the chosen answer, added to the preference loss: RPO (Pang et al. 2024,
    # "Iterative Reasoning Preference Optimization", eq. 3), which found DPO alone lowering the chosen
    # answers' likelihood on math; TRL's 'sft' loss with this weight. 0: plain DPO
    nll_weight: float = Field(0.0, ge=0.0, le=100.0)
    eval_prompts: int = Field(64, ge=0)  # held-out greedy verifier accuracy after training
    eval_max_new_tokens: int = Field(16, ge=1)  # generation budget of those answers
    # Iterative DPO (Pang et al. 2024, "Iterative Reasoning Preference Optimization"; Xiong et al. 2024):
    # round 1 trains on the preferences stage's pairs; each later round samples the current policy with
    # the preferences settings and judge (on fresh RL prompts when data.rl_size > 0, else the training
    # prompts again), pairs, and trains again with the round's starting policy as its reference
    rounds: int = Field(1, ge=1, le=16)

    @model_validator(mode="after")
    def _smoothing(self) -> DPOConfig:
        if self.label_smoothing > 0 and self.loss_type != "robust":
            raise ValueError(
                f"label_smoothing: only loss_type 'robust' uses it (TRL 1.16 'sigmoid' ignores it), "
                f"got {self.label_smoothing} with {self.loss_type!r}"
            )
        return self


class KTOConfig(TrainerOptions):
    """KTO (Ethayarajh et al. 2024) on unpaired desirable/undesirable completions, TRL KTOTrainer."""

    enabled: bool = False  # run KTO
    learning_rate: float = Field(5e-7, gt=0.0, lt=1.0)  # peak learning rate (AdamW)
    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"  # apo_zero_unpaired: D'Oosterlinck et al. 2024
    beta: float = Field(0.1, gt=0.0)  # deviation from the reference; higher stays closer
    # Eq. 8 of the paper: weight desirable vs undesirable losses when the classes are imbalanced
    desirable_weight: float = Field(1.0, gt=0.0)
    undesirable_weight: float = Field(1.0, gt=0.0)  # weight of the undesirable examples' losses
    eval_prompts: int = Field(64, ge=0)  # held-out greedy verifier accuracy after training
    eval_max_new_tokens: int = Field(16, ge=1)  # generation budget of those answers

    def needs_kl(self) -> bool:
        return self.loss_type == "kto"

    @field_validator("launch")
    @classmethod
    def _one_process(cls, v: LaunchConfig) -> LaunchConfig:
        # TRL fills KTO's reference columns per rank inside its own preprocessing, which our cache
        # override replaces; a sharded fill is not written yet.
        if v.processes > 1:
            raise ValueError(f"processes: KTO runs in one process in this version, got {v.processes}")
        return v

    @model_validator(mode="after")
    def _kl_batch(self) -> KTOConfig:
        if self.needs_kl() and self.per_device_batch_size < 2:
            raise ValueError(
                "per_device_batch_size: KTO estimates its KL term from mismatched pairs inside a batch, "
                f"so it needs at least 2, got {self.per_device_batch_size}"
            )
        return self


FUNCTION = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"  # 'package.module:function'


class RewardSpec(Strict):
    """One term of the RL reward; the terms are summed with their weights (TRL's reward_funcs and reward_weights)."""

    # verifier: the task's check (reasoning-gym's for data.task; data.verifier against data.answer_column for
    # data.prompts_path); math_verify: the completion's answer against the row's `column` with HF's math-verify
    # (integers, fractions, decimals, LaTeX, \boxed{}); reward_model: the trained reward model; function: a
    # function of yours, `function` ('module:function') with TRL's signature (prompts, completions,
    # completion_ids, **columns) -> one float per completion, every other column of the prompt row by name
    kind: Literal["verifier", "math_verify", "reward_model", "function"]
    weight: float = Field(1.0, allow_inf_nan=False)
    column: str = Field("answer", min_length=1, max_length=100)  # math_verify: the gold answers' column
    function: str | None = Field(None, max_length=300, pattern=FUNCTION)  # kind function: 'module:function'
    name: str | None = Field(None, pattern=r"^[a-z0-9_]{1,40}$")  # metric name <algo>/reward/<name> (default: derived)

    @model_validator(mode="after")
    def _function(self) -> RewardSpec:
        if (self.kind == "function") != (self.function is not None):
            raise ValueError("function: set it exactly when kind is 'function' ('module:function')")
        return self

    def label(self) -> str:
        """The term's name in metrics and the experience table."""
        return self.name or (self.function.rpartition(":")[2].lower() if self.function else self.kind)


class EnvironmentConfig(Strict):
    """Multi-turn episodes (rlhf/envs/): the policy's turns alternate with an environment's answers, whose
    tokens are masked out of every loss term."""

    # calculator (built in: `<calc>12*7</calc>` answered `<result>84</result>`), feedback (built in: a
    # wrong answer is told so in the next user turn and tried again), hanoi (built in: reasoning-gym's
    # tower_of_hanoi played move by move, the pegs shown after each turn; reward 1 when solved), or a class
    # of yours, 'module:Class' with reset(problem) and step(turn) -> (observation, reward, done)
    name: str = Field(pattern=r"^(calculator|feedback|hanoi|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$", max_length=300)
    # keyword arguments for the class (feedback: attempt_cost, the reward taken off per wrong attempt,
    # and message); checked against its signature before the run starts
    options: dict[Annotated[str, Field(pattern=r"^[A-Za-z_]\w{0,63}$")],
                  Annotated[str, Field(max_length=2000)] | StrictInt | Annotated[float, Field(strict=True, allow_inf_nan=False)]
                  | StrictBool] = Field(
        default_factory=dict, max_length=32)
    max_turns: int = Field(4, ge=1, le=64)  # policy turns per episode (rollout.max_new_tokens bounds each)
    max_tokens: int = Field(256, ge=1, le=65_536)  # the episode's tokens after the prompt, both sides'
    # the environment runs in a child process: a call past timeout_s, or the child past memory_mb, ends the
    # episode with the error recorded (rlhf/envs/sandbox.py)
    timeout_s: float = Field(5.0, gt=0.0, le=3600.0)
    memory_mb: int = Field(1024, ge=64, le=1_048_576)  # the child's address-space cap (RLIMIT_AS)
    max_observation_chars: int = Field(2000, ge=1, le=1_000_000)  # an observation is cut to this


class RLOptions(Placement):
    """Batch shape of one RL iteration; shared by PPO and GRPO."""

    enabled: bool = False  # run this RL stage
    # the policy it starts from, which is also its reference (KL term; with LoRA, the adapters off): the SFT
    # policy (the base model when sft is off), or the DPO / KTO policy trained from it, so that RL with
    # verifiable rewards follows preference tuning as in Tulu 3 (Lambert et al. 2024: SFT -> DPO -> RLVR)
    init_from: Literal["sft", "dpo", "kto"] = "sft"
    iterations: int = Field(20, ge=1, le=10_000_000)  # rollout -> reward -> update rounds
    prompts_per_iteration: int = Field(8, ge=1)  # training prompts sampled per iteration
    epochs: int = Field(1, ge=1)  # K optimisation epochs over each batch of experience
    minibatch_size: int = Field(8, ge=1)  # rollouts per optimizer step; divides the rollouts per iteration
    gradient_accumulation_steps: int = Field(1, ge=1)  # micro-batches per minibatch (same gradient, less memory)
    learning_rate: float = Field(1e-6, gt=0.0, lt=1.0)  # policy learning rate (AdamW; the critic uses it too)
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0)  # Schulman et al. 2017, eq. 7
    dual_clip: float | None = Field(None, gt=1.0)  # Ye et al. 2020: bound for negative advantages
    # verifier: the task's rule-based check (RLVR); reward_model: the trained RM; sum: verifier + RM;
    # function: `reward_function` ('module:function', TRL's signature (prompts, completions, **kw)).
    reward_source: Literal["verifier", "reward_model", "sum", "function"] = "verifier"
    reward_function: str | None = Field(None, max_length=300, pattern=FUNCTION)  # 'module:function' when reward_source is 'function'
    # a weighted sum of reward terms; when set, it replaces reward_source and reward_function (`rlhf validate`
    # prints the terms that apply). E.g. math_verify against an answer column plus 0.1 x a format function:
    # every term's mean is logged per iteration and kept in the experience table
    rewards: list[RewardSpec] = Field(default_factory=list)
    # adamw_torch_fused: adamw_torch's update in one kernel per step (torch's fused=True: 0.07 s against
    # 0.37 s a step for 135M weights on 2 CPU cores); adamw_bnb_8bit: 8-bit AdamW states (bitsandbytes)
    optim: Literal["adamw_torch_fused", "adamw_torch", "adamw_bnb_8bit"] = "adamw_torch_fused"
    max_grad_norm: float = Field(1.0, gt=0.0)  # gradient clipping by global norm
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, slower
    save_every: int = Field(5, ge=1)  # checkpoint (policy, critic, optimizers, KL controller) every N iterations
    max_kl: float = Field(10.0, gt=0.0, allow_inf_nan=False)  # hard stop: mean per-sequence KL above this ends the stage
    # logp_old, the ratio's denominator: recompute it with a forward pass before the update, or take the
    # sampler's log-probs (saves that pass; exact only for the same weights and numerics, and not with
    # top_p < 1, which renormalises the sampler's distribution; logp_mismatch_* report the gap)
    logp_old: Literal["recompute", "rollout"] = "recompute"
    # weigh each token's loss by pi_trainer / pi_sampler, truncated at sampler_correction_cap or masked above
    # it, per token or per sequence (TIS / MIS, Yao et al. 2025; TRL's vllm_importance_sampling_mode): for a
    # sampler whose numbers differ from the trainer's (vLLM); needs logp_old: recompute
    sampler_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "none"
    sampler_correction_cap: float = Field(3.0, gt=1.0, le=1e6)  # TRL's vllm_importance_sampling_clip_max
    # LoRA on the policy: the reference is then the same model with its adapters off (no second copy)
    lora: LoraConfig = LoraConfig()
    eval_prompts: int = Field(64, ge=0)  # held-out greedy verifier accuracy after training
    eval_max_new_tokens: int = Field(16, ge=1)  # generation budget of those answers
    # several processes: rollouts sharded by engine batch, gradients summed across ranks (ddp only)
    launch: LaunchConfig = LaunchConfig()
    # multi-turn episodes with a tool or another environment; null: one answer per sample
    environment: EnvironmentConfig | None = None

    def rollouts_per_iteration(self) -> int:
        return self.prompts_per_iteration * self.samples_per_prompt()

    def frozen_models(self) -> list[str]:
        """The frozen models this loop scores with, besides the policy: a reference model (when the
        algorithm's `uses_reference`; not with LoRA, whose reference is the policy with its adapters off)
        and a reward model."""
        return (["reference"] if self.uses_reference() and not self.lora.enabled else []) + (
            ["reward_model"] if self.uses_reward_model() else [])

    def reward_specs(self) -> list[RewardSpec]:
        """The reward's terms: `rewards`, or the one or two that reward_source names."""
        if self.rewards:
            return list(self.rewards)
        if self.reward_source == "function":
            return [RewardSpec(kind="function", function=self.reward_function)]
        kinds = {"verifier": ["verifier"], "reward_model": ["reward_model"], "sum": ["verifier", "reward_model"]}
        return [RewardSpec(kind=k) for k in kinds[self.reward_source]]

    def uses_reward_model(self) -> bool:
        return any(r.kind == "reward_model" for r in self.reward_specs())

    def samples_per_prompt(self) -> int:
        return 1

    @model_validator(mode="after")
    def _minibatch(self) -> RLOptions:
        if self.sampler_correction != "none" and self.logp_old == "rollout":
            raise ValueError("sampler_correction: needs logp_old: recompute (with the sampler's log-probs as logp_old "
                             f"there is no trainer log-prob to correct towards), got {self.sampler_correction!r}")
        if (self.reward_source == "function") != (self.reward_function is not None):
            raise ValueError("reward_function: set it exactly when reward_source is 'function' ('module:function')")
        labels = [r.label() for r in self.rewards]
        if len(set(labels)) != len(labels):
            raise ValueError(f"rewards: two terms share a name {labels}; give one a `name`")
        if self.minibatch_size % self.gradient_accumulation_steps:
            raise ValueError(f"gradient_accumulation_steps: must divide minibatch_size ({self.minibatch_size}), "
                             f"got {self.gradient_accumulation_steps}")
        if self.launch.strategy != "ddp":
            raise ValueError(f"launch.strategy: the RL loop shards data only ('ddp'), got {self.launch.strategy!r}")
        if self.minibatch_size % (self.gradient_accumulation_steps * self.launch.processes):
            raise ValueError(f"launch.processes: each rank needs a micro-batch: gradient_accumulation_steps x processes "
                             f"({self.gradient_accumulation_steps} x {self.launch.processes}) must divide minibatch_size "
                             f"({self.minibatch_size})")
        n = self.rollouts_per_iteration()
        if n % self.minibatch_size:
            raise ValueError(
                f"minibatch_size: must divide the rollouts per iteration ({n} = prompts_per_iteration "
                f"x samples per prompt), got {self.minibatch_size}"
            )
        return self


class KLControlConfig(Strict):
    mode: Literal["fixed", "adaptive"] = "fixed"  # fixed beta, or the adaptive controller toward `target`
    beta: float = Field(0.05, ge=0.0)  # KL penalty coefficient in r - beta * KL (initial value when adaptive)
    target: float = Field(6.0, gt=0.0)  # adaptive controller, Ziegler et al. 2019, sec. 2.2
    horizon: int = Field(10000, ge=1)  # adaptive controller horizon in samples


class PPOConfig(RLOptions):
    gamma: float = Field(1.0, ge=0.0, le=1.0)  # discount per token
    lam: float = Field(0.95, ge=0.0, le=1.0)  # GAE, Schulman et al. 2016
    vf_coef: float = Field(0.1, ge=0.0)  # weight of the value loss
    value_clip: float = Field(0.2, gt=0.0)  # clip range of the value update around the old values
    entropy_coef: float = Field(0.0, ge=0.0)  # entropy bonus weight
    # backbone of the critic (value head added): the SFT model or the reward model
    critic_init: Literal["sft", "reward_model"] = "sft"
    kl: KLControlConfig = KLControlConfig()

    def uses_reference(self) -> bool:
        return self.kl.beta > 0 or self.kl.mode == "adaptive"  # the KL penalty, or a controller that may raise it


class GRPOConfig(RLOptions):
    group_size: int = Field(4, ge=2)  # G samples per prompt (Shao et al. 2024)
    beta: float = Field(0.04, ge=0.0)  # k3 KL penalty weight in the loss (DeepSeekMath sec. 4.1)
    clip_eps_high: float | None = Field(None, gt=0.0, lt=1.0)  # DAPO clip-higher (Yu et al. 2025)
    # drop groups whose G rewards are all equal before scoring and updating: their advantages are 0, so
    # they cost a full forward/backward for no policy gradient (DAPO's dynamic sampling, Yu et al. 2025,
    # sec. 3.2; its refill of the dropped groups is refill_rounds below)
    skip_uniform_groups: bool = False
    # with skip_uniform_groups: up to this many extra sampling rounds per iteration, each on fresh prompts
    # for the missing groups, until prompts_per_iteration groups are informative (DAPO's refill; 0: none)
    refill_rounds: int = Field(0, ge=0, le=16)
    minibatch_size: int = Field(16, ge=1)  # rollouts per optimizer step; divides prompts x group_size
    # how per-token losses add up (TRL's GRPOConfig.loss_type): dapo, every token alike (TRL's default);
    # grpo, each answer's token mean (DeepSeekMath eq. 3: long wrong answers are pushed down less);
    # dr_grpo, the token sum over answers x rollout.max_new_tokens (Dr. GRPO, Liu et al. 2025)
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = "dapo"
    # advantages r - mean_g divided by the group's std (group), the batch's std (batch) or not at all
    # (none: Dr. GRPO, which finds the group std a question-level difficulty bias); TRL's scale_rewards
    scale_rewards: Literal["group", "batch", "none"] = "group"

    @model_validator(mode="after")
    def _refill(self) -> GRPOConfig:
        if self.refill_rounds and not self.skip_uniform_groups:
            raise ValueError("refill_rounds: refills the groups skip_uniform_groups drops; set skip_uniform_groups: true")
        return self

    def samples_per_prompt(self) -> int:
        return self.group_size

    def uses_reference(self) -> bool:
        return self.beta > 0  # the k3 term in the loss


POLICY_STAGES = ("sft", "dpo", "kto", "ppo", "grpo")


def policy_kind(policy: str) -> str:
    """'base', 'stage' (this run's), 'run' ('<run>/<stage>': another run's in the same store) or 'model'."""
    if policy == "base":
        return "base"
    if policy.startswith("model:"):
        return "model"
    return "run" if "/" in policy else "stage"


class EvalConfig(Placement):
    enabled: bool = False  # run the evaluation
    # base: the configured model; sft, dpo, kto, ppo, grpo: that stage's `model/` in this run; <run>/<stage>:
    # another run's, from the same store (e.g. exp1/grpo); model:<hub id or local folder>: any model. Each
    # policy's answers are kept per (weights, prompts, sampling settings) in the store and reused, so
    # adding a policy generates only its own (`rlhf leaderboard` rates every policy kept there)
    policies: list[str] = Field(default_factory=lambda: ["base", "sft"], max_length=64)
    anchor: str = "sft"  # rated 1000 on the Elo scale
    # who decides a battle: the task's verifier, the reward model, or both (separate ratings)
    judge: Literal["verifier", "reward_model", "both"] = "verifier"
    tie_margin: float = Field(0.0, ge=0.0)  # reward-model judge: |r_a - r_b| <= margin is a tie
    bootstrap_rounds: int = Field(1000, ge=1)  # bootstrap resamples for the Elo confidence intervals
    prompts: int = Field(64, ge=1)  # held-out prompts (at most data.eval_size)
    samples_per_prompt: int = Field(1, ge=1)  # answers per prompt and policy (needs temperature > 0 for more than 1)
    temperature: float = Field(0.0, ge=0.0)  # 0: greedy; the same sampling params and seed for every policy
    top_p: float = Field(1.0, gt=0.0, le=1.0)  # nucleus sampling
    max_new_tokens: int = Field(32, ge=1)  # answer budget in tokens
    batch_size: int = Field(32, ge=1)  # answers (prompt x sample) per generate call
    seed: int = Field(0, ge=0, lt=2**32)  # sampling seed shared by every policy
    # answer as episodes with this environment (e.g. the one grpo trained with): every policy plays the same
    # prompts and seeds, the judges see the whole transcript, and the metrics add turns, environment tokens
    # and errors per episode. Episodes are not kept in the answers cache (`rlhf leaderboard` does not see them)
    environment: EnvironmentConfig | None = None

    @field_validator("policies")
    @classmethod
    def _policies(cls, v: list[str]) -> list[str]:
        for p in v:
            kind = policy_kind(p)
            if kind == "stage" and p not in POLICY_STAGES:
                raise ValueError(f"{p!r} is not a policy: base, {', '.join(POLICY_STAGES)}, <run>/<stage> (another "
                                 "run's) or model:<hub id or local folder>")
            if kind == "run":
                run, _, stage = p.partition("/")
                check_name("run", run)
                if stage not in POLICY_STAGES:
                    raise ValueError(f"{p!r}: {stage!r} is not a policy stage ({', '.join(POLICY_STAGES)})")
            if kind == "model" and not re.fullmatch(r"model:[^\s\x00-\x1f]{1,300}", p):
                raise ValueError(f"{p!r}: model:<hub id or local folder>, without spaces or control characters")
        return v

    @model_validator(mode="after")
    def _anchor(self) -> EvalConfig:
        if len(set(self.policies)) < 2 or len(set(self.policies)) != len(self.policies):
            raise ValueError(f"policies: need at least two distinct policies to compare, got {self.policies}")
        if self.temperature == 0 and self.samples_per_prompt > 1:
            raise ValueError("samples_per_prompt: greedy decoding (temperature 0) gives one sample per prompt")
        if self.anchor not in self.policies:
            raise ValueError(f"anchor: must be one of eval.policies {self.policies}, got {self.anchor!r}")
        return self


class PipelineConfig(Strict):
    profile: str = "default"
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    storage: StorageConfig = StorageConfig()
    tracking: TrackingConfig = TrackingConfig()
    sft: SFTConfig = SFTConfig()
    reward_model: RewardModelConfig = RewardModelConfig()
    ref_logprobs: RefLogprobsConfig = RefLogprobsConfig()
    preferences: PreferencesConfig = PreferencesConfig()
    rollout: RolloutConfig = RolloutConfig()
    dpo: DPOConfig = DPOConfig()
    kto: KTOConfig = KTOConfig()
    ppo: PPOConfig = PPOConfig()
    grpo: GRPOConfig = GRPOConfig()
    eval: EvalConfig = EvalConfig()

    def stage(self, name: str) -> Strict:
        return getattr(self, name)

    def work_pool(self, stage: str) -> str:
        """The Prefect work pool `stage` runs on: its own, else the run's default for stages."""
        return self.stage(stage).work_pool or self.run.stage_work_pool

    @model_validator(mode="before")
    @classmethod
    def _ref_length_follows_dpo(cls, data):
        # ref_logprobs.max_length: null means dpo's, filled in here so that manifests and keys carry the number
        if not isinstance(data, dict):
            return data
        ref, dpo = data.get("ref_logprobs", {}), data.get("dpo", {})
        ref = ref.model_dump() if isinstance(ref, BaseModel) else ref
        if isinstance(ref, dict) and ref.get("max_length") is None:
            length = dpo.get("max_length") if isinstance(dpo, dict) else getattr(dpo, "max_length", None)
            data = {**data, "ref_logprobs": {**ref, "max_length": length or DPOConfig.model_fields["max_length"].default}}
        return data

    def _async_rollout(self) -> None:
        """What rollout.async needs of each enabled RL stage."""
        if (lag := self.rollout.async_) is None:
            return
        for name in ("ppo", "grpo"):
            stage = getattr(self, name)
            if not stage.enabled:
                continue
            if stage.launch.processes > 1:
                raise ValueError(f"rollout.async: {name} samples on a thread of its one process for now; set "
                                 f"{name}.launch.processes: 1")
            if lag.max_lag > 0 and stage.logp_old == "recompute" and stage.sampler_correction == "none":
                raise ValueError(f"rollout.async.max_lag: {lag.max_lag} samples with a policy up to {lag.max_lag} "
                                 f"updates older than the trainer's; {name} must weigh that: set {name}.logp_old: "
                                 f"rollout (the ratio against the sampler's log-probs) or {name}.sampler_correction "
                                 "(token_truncate: TIS)")

    @model_validator(mode="before")
    @classmethod
    def _reward_model_kind(cls, data):
        if not isinstance(data, dict):
            return data
        rm = data.get("reward_model", {})
        rm = rm.model_dump() if isinstance(rm, BaseModel) else rm
        if isinstance(rm, dict) and rm.get("kind", "auto") == "auto":
            d = data.get("data", {})
            prefs_path = d.get("prefs_path") if isinstance(d, dict) else getattr(d, "prefs_path", None)
            data = {**data, "reward_model": {**rm, "kind": auto_reward_model_kind(prefs_path is not None, rm)}}
        return data

    @model_validator(mode="after")
    def _cross(self) -> PipelineConfig:
        self._async_rollout()
        if self.reward_model.enabled and self.reward_model.init_from == "sft" and not self.sft.enabled:
            raise ValueError("reward_model.init_from: 'sft' needs sft.enabled: true; use 'base' or enable sft")
        prefs = self.preferences
        if prefs.enabled and prefs.policy == "sft" and not self.sft.enabled:
            raise ValueError("preferences.policy: 'sft' needs sft.enabled: true; use 'base' or enable sft")
        if prefs.enabled and self.data.prefs_path is not None:
            raise ValueError("preferences.enabled: data.prefs_path is set too; say which pairs to train on by "
                             "disabling one of them")
        if prefs.enabled and prefs.eval_prompts > self.data.eval_size:
            raise ValueError(f"preferences.eval_prompts: at most data.eval_size ({self.data.eval_size}), "
                             f"got {prefs.eval_prompts}")
        if self.eval.enabled and self.eval.prompts > self.data.eval_size:
            raise ValueError(f"eval.prompts: at most data.eval_size ({self.data.eval_size}), got {self.eval.prompts}")
        synthetic = not prefs.enabled and self.data.prefs_path is None
        if self.reward_model.enabled and synthetic:
            held_out = max(1, round(self.data.train_size * self.reward_model.eval_fraction))
            if self.data.train_size - held_out < 1:
                raise ValueError(f"data.train_size: {self.data.train_size} synthetic pairs leave none to train the "
                                 f"reward model on after holding out {held_out} (reward_model.eval_fraction)")
        if self.dpo.enabled and not self.ref_logprobs.enabled:
            raise ValueError("dpo.enabled: DPO reads cached reference log-probs; set ref_logprobs.enabled: true")
        if self.dpo.enabled and self.dpo.max_length != self.ref_logprobs.max_length:
            raise ValueError(
                f"dpo.max_length: must equal ref_logprobs.max_length ({self.ref_logprobs.max_length}) so the cached "
                f"reference log-probs see the same truncation, got {self.dpo.max_length}"
            )
        if self.dpo.enabled and self.dpo.rounds > 1:
            self._dpo_rounds()
        if self.eval.enabled:
            for policy in self.eval.policies:
                if policy_kind(policy) == "stage" and not self.stage(policy).enabled:
                    raise ValueError(f"eval.policies: {policy!r} needs {policy}.enabled: true")
            if self.eval.judge != "verifier" and not self.reward_model.enabled:
                raise ValueError(f"eval.judge: {self.eval.judge!r} needs reward_model.enabled: true")
            if self.eval.judge != "reward_model" and self.data.open_ended():
                raise ValueError(f"eval.judge: {self.eval.judge!r} needs gold answers, and data.answer_column is null "
                                 "(open-ended prompts): use eval.judge: reward_model")
        if self.preferences.enabled and self.preferences.judge == "verifier" and self.data.open_ended():
            raise ValueError("preferences.judge: 'verifier' needs gold answers, and data.answer_column is null "
                             "(open-ended prompts): use judge reward_model or function")
        for name in ("ppo", "grpo"):
            rl = self.stage(name)
            if rl.enabled and rl.init_from != "sft" and not self.stage(rl.init_from).enabled:
                raise ValueError(f"{name}.init_from: {rl.init_from!r} needs {rl.init_from}.enabled: true "
                                 f"(or {name}.init_from: sft)")
            pool = self.data.rl_size or self.data.train_size  # what Task.rl draws from (rl_size 0: the SFT problems)
            if rl.enabled and rl.prompts_per_iteration > pool:
                raise ValueError(f"{name}.prompts_per_iteration: each iteration draws distinct prompts from the RL pool "
                                 f"of {pool} (data.rl_size, or data.train_size when it is 0), got {rl.prompts_per_iteration}")
            if rl.enabled and rl.uses_reward_model() and not self.reward_model.enabled:
                key = "rewards" if rl.rewards else "reward_source"
                raise ValueError(f"{name}.{key}: a reward_model term needs reward_model.enabled: true")
            answers = [r.kind for r in rl.reward_specs() if r.kind in ("verifier", "math_verify")]
            if rl.enabled and answers and self.data.open_ended():
                raise ValueError(f"{name}.{'rewards' if rl.rewards else 'reward_source'}: {answers[0]!r} checks gold "
                                 "answers, and data.answer_column is null (open-ended prompts): reward them with the "
                                 "reward model or a function")
            if rl.enabled and rl.launch.ray.scorers == "own" and not rl.frozen_models():
                raise ValueError(f"{name}.launch.ray.scorers: 'own' but this {name} has no frozen model to place: no "
                                 "reference (KL coefficient 0, or LoRA, whose reference is the policy with its adapters "
                                 "off) and no reward model (reward_source verifier or function)")
            if rl.enabled and self.rollout.engine == "vllm" and (rl.lora.enabled or rl.launch.processes > 1):
                raise ValueError(f"rollout.engine: 'vllm' in the RL loop needs {name}.lora.enabled false and "
                                 f"{name}.launch.processes 1 in this version (weights sync as one merged folder)")
        if self.ppo.enabled and self.ppo.critic_init == "reward_model" and not self.reward_model.enabled:
            raise ValueError("ppo.critic_init: 'reward_model' needs reward_model.enabled: true")
        if self.rollout.enabled and self.rollout.policy != "base" and not self.stage(self.rollout.policy).enabled:
            raise ValueError(f"rollout.policy: {self.rollout.policy!r} needs {self.rollout.policy}.enabled: true")
        return self

    def preference_prompts(self) -> int:
        """Training prompts the preferences stage samples (and each later DPO round, on its own fresh ones)."""
        return min(self.preferences.prompts or self.data.train_size, self.data.train_size)

    def _dpo_rounds(self) -> None:
        dpo, prefs = self.dpo, self.preferences
        if not prefs.enabled:
            raise ValueError(f"dpo.rounds: {dpo.rounds} rounds sample and judge with the preferences settings; "
                             "set preferences.enabled: true")
        if dpo.launch.processes > 1:
            raise ValueError(f"dpo.rounds: later rounds sample in one process; set dpo.launch.processes: 1 "
                             f"(got {dpo.launch.processes})")
        per_round = self.preference_prompts()
        needed = (dpo.rounds - 1) * per_round
        if self.data.rl_size and needed > self.data.rl_size:
            raise ValueError(f"dpo.rounds: {dpo.rounds - 1} later rounds of {per_round} fresh prompts need "
                             f"data.rl_size >= {needed}, got {self.data.rl_size}")
