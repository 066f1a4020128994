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


class RemoteEngine:
    def __init__(self, handle, policy):
        self.handle = handle
        self.sync(policy)  # the actor starts from the init weights; a resumed policy differs from them

    def generate(self, prompts, params, shard=(0, 1), on_batch=None):
        import ray

        return ray.get(self.handle.generate.remote(prompts, params, shard))

    def sync(self, policy) -> float | None:
        """Rank 0 sends the weights (all ranks hold the same after an update); every rank waits until they
        are in, so none samples the next iteration from the old ones. The engine's own check (vLLM's probe
        log-prob difference) comes back on rank 0."""
        import ray

        diff = None
        if dist.is_main():
            state = {k: v.detach().to("cpu") for k, v in policy.state_dict().items()}
            diff = ray.get(self.handle.sync.remote(state))
        dist.barrier()
        return diff

    def close(self) -> None:
        import ray

        if dist.is_main():
            ray.get(self.handle.close.remote())


class RemoteScorers:
    """The frozen models in the scorers' actor (`launch.ray.scorers: own`): each rank sends the rows it
    would have scored itself (rl_loop.reference_logps, make_reward)."""

    def __init__(self, handle):
        self.handle = handle

    def ref_logps(self, batch, temperature: float, size: int):
        import ray

        return ray.get(self.handle.ref_logps.remote(batch, temperature, size))

    def rm_scores(self, conversations: list) -> list[float]:
        import ray

        return ray.get(self.handle.rm_scores.remote(conversations))
