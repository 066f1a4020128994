"""Rank helpers for stages launched with several processes (rlhf/pipeline/launch.py).

A stage run in one process is rank 0 of a world of 1, so stage code calls these unconditionally.
Rule of the house: every rank computes, rank 0 alone writes to the store (checkpoints, models,
tables); the launcher's parent writes the manifest, once.
"""

from __future__ import annotations

import os

# The launcher's name for the machine a rank runs on (Ray: its node id); unset with torchrun, whose ranks
# share one node. Ranks on one node share its scratch folder; ranks on different nodes share only the store.
NODE_ENV = "RLHF_NODE"


_ENGINE_ACTOR = None  # launch.ray.engine: own: the Ray actor this rank samples through (set by the Ray launcher)


def set_engine_actor(handle) -> None:
    global _ENGINE_ACTOR
    _ENGINE_ACTOR = handle


def engine_actor():
    """The rollout engine's actor of this rank's stage, or None (the engine runs in the rank)."""
    return _ENGINE_ACTOR


_SCORER_ACTOR = None  # launch.ray.scorers: own: the Ray actor holding the RL loop's frozen models


def set_scorer_actor(handle) -> None:
    global _SCORER_ACTOR
    _SCORER_ACTOR = handle


def scorer_actor():
    """The actor that holds this rank's reference and reward model, or None (they are in the rank)."""
    return _SCORER_ACTOR


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def world_size() -> int:
    d = _dist()
    return d.get_world_size() if d else 1


def rank() -> int:
    d = _dist()
    return d.get_rank() if d else 0


def is_main() -> bool:
    return rank() == 0


def node() -> str:
    return os.environ.get(NODE_ENV, "")


def is_local_main() -> bool:
    """The first rank on this node: the one that fills the node's scratch folder for the others."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0 if _dist() else True


def barrier() -> None:
    """Wait for every rank (no-op in one process, a process group of one included, so a side thread may
    call it: rollout.async's sampling thread syncs an engine actor): rank 0's writes are visible to all."""
    d = _dist()
    if d and d.get_world_size() > 1:
        d.barrier()


def broadcast(obj):
    """Rank 0's value of a picklable object, on every rank."""
    d = _dist()
    if not d:
        return obj
    box = [obj]
    d.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(obj) -> list:
    """Every rank's value of a picklable object, in rank order, on every rank."""
    d = _dist()
    if not d:
        return [obj]
    out = [None] * d.get_world_size()
    d.all_gather_object(out, obj)
    return out


def sum_gradients(params, bucket_elements: int = 2**24) -> None:
    """All-reduce (sum) the gradients of `params` across ranks, in flat buckets: what DDP does after
    backward, done once per optimizer step because the RL loop weights each micro-batch's loss by its
    share of the whole minibatch's tokens (rlhf/train/rl_loop.py), so the sum is the minibatch gradient."""
    d = _dist()
    if not d:
        return
    import torch
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = []
    for p in params:
        if p.grad is None:  # a rank whose micro-batches never reached this parameter
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    buckets, bucket, size = [], [], 0
    for g in grads:
        if bucket and size + g.numel() > bucket_elements:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel()
    if bucket:
        buckets.append(bucket)
    for bucket in buckets:
        flat = _flatten_dense_tensors(bucket)
        d.all_reduce(flat)
        for g, new in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(new)


def broadcast_parameters(model) -> None:
    """Rank 0's weights on every rank (what DDP does when it wraps a model): a randomly initialised
    head must not differ between ranks."""
    d = _dist()
    if not d:
        return
    for p in model.parameters():
        d.broadcast(p.data, src=0)
