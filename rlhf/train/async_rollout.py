"""Rollouts that do not wait for the trainer (`rollout.async: {max_lag: N}`).

A producer thread samples and scores iteration j's experience with a copy of the policy while the
trainer updates on iteration j - 1's, as in verl's one-step-off-policy trainer and PipelineRL (Piche et
al. 2025), whose `max_lag` bounds how many updates old a sample may be. Here the lag is not whatever the
timing gives: iteration j always samples with the policy after update j - 1 - N (`behaviour_version`),
so a run is reproducible and N = 0 is the synchronous loop, sample for sample. The producer therefore
never runs more than N + 1 iterations ahead, and holds at most N + 1 weight snapshots.

The trainer's ratio then compares its policy with an older one: the config asks for logp_old: rollout
(the ratio is taken against the sampler's own log-probs, the behaviour policy) or a sampler correction
(TIS / MIS weights pi_trainer / pi_sampler) when N > 0.

A thread, not a process: torch releases the GIL in its kernels, the engine's own copy of the weights is
updated in place (no serialisation), and it ends with the process however that ends. On a GPU the
engines that hold their own weights (vLLM, an engine actor) get them through their usual sync.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Callable

import torch


def behaviour_version(it: int, start: int, max_lag: int) -> int:
    """The policy version (updates applied) that samples iteration `it`: it - 1 - max_lag, but never one
    before `start`, the weights the loop started from (0, or a resumed checkpoint's iteration): after a
    resume the first max_lag iterations sample with the checkpoint's weights, a smaller lag."""
    return max(start, it - 1 - max_lag)


def trainable_state(model) -> dict[str, torch.Tensor]:
    """A detached copy of the parameters the optimizer changes (LoRA: the adapters only)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@dataclass
class Draw:
    """One iteration's sampled and scored experience, as the loop consumes it."""

    problems: list
    gens: list  # with skip_uniform_groups: the informative groups, refills included
    scores: torch.Tensor
    sampled: dict  # of everything sampled: n, the first draw's mean reward and its terms' means
    version: int  # the policy version that sampled it
    sync_diff: float | None = None  # the engine's check of its weights after loading that version


class Prefetcher:
    """Samples iterations first..last in order on a thread of its own. `draw(engine, it)` returns the
    fields of a Draw (problems, gens, scores, sampled), refills included; `make_engine(model)` builds the
    engine over the producer's copy of the policy; `amp()` is the mixed-precision context (thread-local in torch, so the
    producer enters its own). The trainer calls `publish(version, policy)` after each iteration's update
    (or its skipped update) and `take(it)` for each iteration's draw."""

    def __init__(self, policy, make_engine: Callable, draw: Callable, first: int, last: int, max_lag: int,
                 amp: Callable, threads: int | None = None):
        self.model = copy.deepcopy(policy).eval().requires_grad_(False)
        self.engine = make_engine(self.model)
        self.draw, self.first, self.last, self.max_lag, self.amp = draw, first, last, max_lag, amp
        self.threads = threads
        self.start = first - 1
        self.version = self.start
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.ready: dict[int, Draw] = {}
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self.thread.start()

    def publish(self, version: int, policy) -> None:
        """The policy after `version` updates: kept while an iteration still to be sampled needs it."""
        if version + 1 + self.max_lag > self.last:  # the iteration it would sample (behaviour_version) is past the end
            return
        state = trainable_state(policy)
        with self.cond:
            self.snapshots[version] = state
            self.cond.notify_all()

    def take(self, it: int) -> Draw:
        """Iteration `it`'s draw, waiting for it; the producer's failure is raised here."""
        with self.cond:
            while it not in self.ready and self.error is None:
                self.cond.wait()
            if it in self.ready:
                return self.ready.pop(it)
        raise self.error

    def close(self, wait: bool = True) -> None:
        """Stop sampling: the producer ends after the call it is in, and closes the engine. `wait`: join it
        (its sampling seeds torch's global generator, which a next stage in this process must have to
        itself); not on a stop signal, which must not wait out a generation."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if wait:
            self.thread.join()

    def _run(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # this thread's (OpenMP's thread count is per thread)
        try:
            for it in range(self.first, self.last + 1):
                want = behaviour_version(it, self.start, self.max_lag)
                with self.cond:
                    while want != self.start and want not in self.snapshots and not self.stopping:
                        self.cond.wait()
                    if self.stopping:
                        return
                    state = self.snapshots.get(want)
                    for v in [v for v in self.snapshots if v < want]:  # no later iteration needs them
                        del self.snapshots[v]
                sync_diff = None
                if want != self.version:
                    params = dict(self.model.named_parameters())
                    with torch.no_grad():
                        for name, value in state.items():
                            params[name].copy_(value)
                    sync_diff = self.engine.sync(self.model)  # engines with weights of their own reload them
                    self.version = want
                with self.amp():
                    fields = self.draw(self.engine, it)
                result = Draw(*fields, version=want, sync_diff=sync_diff)
                with self.cond:
                    self.ready[it] = result
                    self.cond.notify_all()
        except BaseException as e:  # handed to the trainer, which raises it from take()
            with self.cond:
                self.error = e
                self.cond.notify_all()
        finally:
            self.engine.close()
