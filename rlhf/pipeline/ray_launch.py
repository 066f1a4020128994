"""A stage's ranks on a Ray cluster (`<stage>.launch.backend: ray`).

Prefect still orchestrates: the stage's task runs on its work pool and drives the cluster from there. The
launcher reserves one placement group of `processes` bundles (CPUs and GPUs per rank, Ray's PACK / SPREAD
/ STRICT_SPREAD), starts one actor per bundle, and gives each the environment torchrun would (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT of rank 0's node), so every rank runs the same `rank_main` as a
torchrun rank and the HF Trainer and the RL loop need nothing Ray-specific. Plain actors rather than Ray
Train's TorchTrainer: TorchTrainer owns the training loop and the process group, while our stages are
whole `run()` functions that already set up data parallelism through accelerate or the RL loop's own
gradient sum; actors let one entry point serve both launchers.

The RL stages may add up to two bundles after the ranks' (rlhf/core/cluster.py `actor_bundles`): the
rollout engine's actor (`launch.ray.engine: own`) and the frozen scorers' actor (`launch.ray.scorers:
own`), started and loaded before the ranks, which reach them through rlhf/train/remote.py.

Ranks on one node share a scratch folder (`<stage scratch>/nodes/<node id>`); ranks on different nodes
share only the store: each node downloads its inputs once (its first rank), and a rank on another node
than rank 0 uploads its own part of a checkpoint (rlhf/train/training.py). Rank 0 alone writes artifacts;
the runner writes the manifest once, as with torchrun.

A rank that dies (its process killed, its node lost) or raises fails the stage with a message naming
the rank, its node and the cause; the other ranks are killed and the placement group is removed in
every case, so no reservation leaks. A rerun resumes from the last complete checkpoint in the store.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket

from rlhf.core.cluster import actor_bundles, address, address_problem, bundles, describe
from rlhf.core.config import LaunchConfig
from rlhf.core.registry import SPECS
from rlhf.core.dist import NODE_ENV, set_engine_actor, set_scorer_actor
from rlhf.core.stage import StageContext
from rlhf.pipeline.rank import LaunchError, importable_path, rank_context, rank_main

log = logging.getLogger("rlhf.launch")
# The parent's environment a rank needs (store credentials, model cache, test hooks, trackers), and no
# more: a remote node has its own PATH, HOME and Python.
FORWARDED = ("RLHF_", "AWS_", "HF_", "TRANSFORMERS_", "TRACKIO_", "WANDB_", "MLFLOW_")


def rank_envs(where: list[dict], port: int, launch: LaunchConfig, forwarded: dict[str, str]) -> list[dict[str, str]]:
    """torchrun's environment for each rank, from where Ray placed it. `where[r]`: {node, ip, gpus}.
    LOCAL_RANK counts the ranks before r on the same node; with GPUs every rank of a node sees the node's
    reserved GPUs (their union, in order) and LOCAL_RANK indexes its own, as Ray Train does."""
    out = []
    for r, w in enumerate(where):
        same = [x for x in where if x["node"] == w["node"]]
        env = {**forwarded, "RANK": str(r), "WORLD_SIZE": str(len(where)), "LOCAL_WORLD_SIZE": str(len(same)),
               "LOCAL_RANK": str(same.index(w)), "MASTER_ADDR": where[0]["ip"], "MASTER_PORT": str(port),
               NODE_ENV: w["node"], "OMP_NUM_THREADS": str(max(1, int(launch.ray.cpus_per_rank)))}
        if launch.ray.gpus_per_rank:
            gpus = sorted({g for x in same for g in x["gpus"]}, key=lambda g: (len(g), g))
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            env["LOCAL_RANK"] = str(gpus.index(w["gpus"][0]))
        out.append(env)
    return out


def _rank_actor():
    import ray

    class Rank:
        def where(self) -> dict:
            ctx = ray.get_runtime_context()
            return {"node": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                    "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

        def free_port(self) -> int:
            with socket.socket() as s:
                s.bind(("", 0))
                return s.getsockname()[1]

        def run(self, spec: dict, env: dict[str, str], engine=None, scorers=None) -> dict | None:
            os.environ.update(env)
            set_engine_actor(engine)
            set_scorer_actor(scorers)
            return rank_main(spec)

    return ray.remote(Rank)


def _actor_classes() -> dict:
    import ray

    class EngineHost:
        """The RL loop's rollout engine on a bundle of its own (launch.ray.engine: own): a copy of the policy
        and the configured engine over it; rank 0 replaces the weights after every update."""

        def start(self, spec: dict, env: dict[str, str]) -> None:
            os.environ.update(env)
            ctx = rank_context(spec)
            stage = importlib.import_module(SPECS[ctx.stage].module)  # ppo / grpo: the RL loop's engine_host
            self.engine, self.policy, self.amp = stage.engine_host(ctx.cfg.stage(ctx.stage), ctx)

        def generate(self, prompts, params, shard):
            with self.amp():  # the trainer's numerics: a colocated engine samples under the same context
                return self.engine.generate(prompts, params, shard)

        def continue_ids(self, seqs, params, stop, seed):  # one turn of episodes; the environment stays in the rank
            with self.amp():
                return self.engine.continue_ids(seqs, params, stop, seed)

        def sync(self, state: dict) -> float | None:
            self.policy.load_state_dict(state)
            return self.engine.sync(self.policy)

        def close(self) -> None:
            self.engine.close()

    class ScorerHost:
        """The RL loop's frozen models on a bundle of their own (launch.ray.scorers: own): the reference
        policy and the reward model, loaded as a rank would load them (rl_loop.LocalScorers)."""

        def start(self, spec: dict, env: dict[str, str]) -> None:
            os.environ.update(env)
            ctx = rank_context(spec)
            self.scorers = importlib.import_module(SPECS[ctx.stage].module).scorer_host(ctx.cfg.stage(ctx.stage), ctx)

        def ref_logps(self, batch, temperature: float, size: int):
            return self.scorers.ref_logps(batch, temperature, size)

        def rm_scores(self, conversations: list) -> list[float]:
            return self.scorers.rm_scores(conversations)

    return {"engine": ray.remote(EngineHost), "scorers": ray.remote(ScorerHost)}


def run_on_ray(ctx: StageContext, launch: LaunchConfig, spec: dict) -> dict:
    """Runs the stage's ranks in a placement group; returns rank 0's StageResult as a dict."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    addr = address(launch.ray)
    if why := address_problem(addr):
        raise LaunchError(f"{ctx.stage}.launch.ray.address: {why}")
    connected_here = not ray.is_initialized()
    if connected_here:
        ray.init(address=addr, logging_level=logging.WARNING, runtime_env={"env_vars": {"PYTHONPATH": importable_path()}})
    want = bundles(launch)
    pg = placement_group(want, strategy=launch.ray.strategy)
    actors: list = []
    try:
        try:
            ray.get(pg.ready(), timeout=launch.ray.ready_seconds)
        except ray.exceptions.GetTimeoutError:
            raise LaunchError(f"{ctx.stage}.launch.ray: the cluster at {addr} did not place {describe(launch)} within "
                                 f"{launch.ray.ready_seconds:g} s") from None
        actor = _rank_actor()
        actors = [actor.options(num_cpus=b["CPU"], num_gpus=b.get("GPU", 0), max_restarts=0,
                                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote()
                  for i, b in enumerate(want[: launch.processes])]
        forwarded = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED)}
        started = {}  # role -> actor: loaded before the ranks need them
        for i, (role, b) in enumerate(actor_bundles(launch), start=launch.processes):
            started[role] = _actor_classes()[role].options(
                num_cpus=b["CPU"], num_gpus=b.get("GPU", 0), max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote()
            actors.append(started[role])
            try:
                ray.get(started[role].start.remote({**spec, "workdir": str(ctx.workdir / role)},
                                                   {**forwarded, "OMP_NUM_THREADS": str(max(1, int(b["CPU"])))}))
            except ray.exceptions.RayError as e:
                cause = getattr(e, "cause", None) or e
                raise LaunchError(f"stage {ctx.stage!r}: the {role} actor did not start: "
                                  f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}") from None
        ranks = actors[: launch.processes]
        where = ray.get([a.where.remote() for a in ranks])
        port = ray.get(ranks[0].free_port.remote())
        envs = rank_envs(where, port, launch, forwarded)
        ctx.log.info("%s: %d ranks on Ray (%s) on nodes %s", ctx.stage, len(ranks), describe(launch),
                     ", ".join(f"{w['node'][:12]} (pid {w['pid']})" for w in where))
        refs = [a.run.remote({**spec, "workdir": str(ctx.workdir / "nodes" / w["node"][:16])}, env,
                             started.get("engine"), started.get("scorers"))
                for a, w, env in zip(ranks, where, envs)]
        return _results(ray, refs, where, ctx.stage)[0]
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)
        if connected_here:
            ray.shutdown()


def _results(ray, refs: list, where: list[dict], stage: str) -> list:
    """Every rank's return value; the first rank to fail fails the stage, naming itself (the others would
    wait for it in a collective until the process group's timeout)."""
    rank_of = {ref: r for r, ref in enumerate(refs)}
    pending, out = list(refs), [None] * len(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        r = rank_of[done[0]]
        try:
            out[r] = ray.get(done[0])
        except ray.exceptions.RayActorError as e:
            raise LaunchError(f"stage {stage!r}: rank {r} on node {where[r]['node'][:12]} ({where[r]['ip']}, pid "
                                 f"{where[r]['pid']}) died: {str(e).splitlines()[0]}") from None
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            raise LaunchError(f"stage {stage!r}: rank {r} on node {where[r]['node'][:12]} ({where[r]['ip']}) failed: "
                                 f"{type(cause).__name__}: {cause}") from None
    return out
