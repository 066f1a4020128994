"""The RL loop's side of a rollout engine that lives in an actor of its own (`launch.ray.engine: own`).

The Ray launcher (rlhf/pipeline/ray_launch.py) starts the engine actor on its own bundle of the stage's
placement group and hands every rank its handle (`dist.engine_actor()`); the RL loop then samples through
`RemoteEngine`, which has the `Engine` interface. The actor holds a copy of the policy; after every
update rank 0 sends the policy's weights through Ray's object store (the layout OpenRLHF and verl use
when the sampler has GPUs of its own). Generation is seeded per engine batch (rlhf/engines/engine.py), so
samples are the ones a colocated engine would draw from the same weights.
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
