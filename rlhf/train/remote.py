"""The RL loop's side of the actors the Ray launcher (rlhf/pipeline/ray_launch.py) can give an RL stage
on bundles of their own, in the stage's placement group:

- `launch.ray.engine: own`: the rollout engine. The actor holds a copy of the policy; the ranks sample
  their share of the engine batches through `RemoteEngine`, which has the `Engine` interface, and after
  every update rank 0 sends the policy's weights through Ray's object store (the split OpenRLHF and verl
  make when the sampler has GPUs of its own). Generation is seeded per engine batch
  (rlhf/engines/engine.py), so the samples are the ones a colocated engine would draw from the same weights.
- `launch.ray.scorers: own`: the frozen models (reference policy, reward model). Each rank sends the rows
  it would have scored itself (`RemoteScorers`).

The launcher hands every rank the actors' handles (`dist.engine_actor()`, `dist.scorer_actor()`).
"""

from __future__ import annotations

from rlhf.core import dist


class ActorLost(RuntimeError):
    """The engine's or the scorers' actor died (its process killed, its node lost): the stage fails, and a
    rerun resumes from the last complete checkpoint."""


def call(handle, role: str, method: str, *args):
    """`handle.method(*args)` on the actor, waited for; a dead actor fails with its role named."""
    import ray

    try:
        return ray.get(getattr(handle, method).remote(*args))
    except ray.exceptions.RayActorError as e:
        raise ActorLost(f"the RL loop's {role} actor died during {method}: {str(e).splitlines()[0]}") from None


class RemoteEngine:
    def __init__(self, handle, policy, tokenizer):
        self.handle, self.tokenizer = handle, tokenizer
        self.sync(policy)  # the actor starts from the init weights; a resumed policy differs from them

    def generate(self, prompts, params, shard=(0, 1), on_batch=None):
        return call(self.handle, "rollout engine", "generate", prompts, params, shard)

    def continue_ids(self, seqs, params, stop, seed):
        """One more turn of each episode, sampled by the actor; the environment's process stays in the rank
        (rlhf/envs/episodes.py), so only token ids cross."""
        return call(self.handle, "rollout engine", "continue_ids", seqs, params, stop, seed)

    def sync(self, policy) -> float | None:
        """Rank 0 sends the weights (all ranks hold the same after an update); every rank waits until they
        are in, so none samples the next iteration from the old ones. The engine's own check (vLLM's probe
        log-prob difference) comes back on rank 0."""
        diff = None
        if dist.is_main():
            state = {k: v.detach().to("cpu") for k, v in policy.state_dict().items()}
            diff = call(self.handle, "rollout engine", "sync", state)
        dist.barrier()
        return diff

    def close(self) -> None:
        if dist.is_main():
            call(self.handle, "rollout engine", "close")


class RemoteScorers:
    """The frozen models in the scorers' actor (`launch.ray.scorers: own`): each rank sends the rows it
    would have scored itself (rl_loop.reference_logps, make_reward)."""

    def __init__(self, handle):
        self.handle = handle

    def ref_logps(self, batch, temperature: float, size: int):
        return call(self.handle, "scorers", "ref_logps", batch, temperature, size)

    def rm_scores(self, conversations: list) -> list[float]:
        return call(self.handle, "scorers", "rm_scores", conversations)
