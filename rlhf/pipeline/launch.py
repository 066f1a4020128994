"""Run one stage with N data-parallel processes on this node (torchrun), or in-process when N is 1.

The runner calls `run_stage`; with `<stage>.launch.processes > 1` it writes a launch spec into the
stage's scratch and starts `python -m torch.distributed.run --standalone --nproc_per_node N -m
rlhf.pipeline.launch SPEC`. Every rank rebuilds the config and store from the spec and calls the stage's own
`run()`; the HF Trainer (through accelerate) sees the torchrun environment and trains data-parallel,
and the RL loop shards its rollouts (rlhf/train/rl_loop.py). Rank 0 alone writes artifacts and the result file;
the parent process turns that into the manifest, so a manifest is written exactly once. The workers'
output is relayed line by line into the stage's log (and so into Prefect's logs).
With `launch.backend: ray` the ranks run in a placement group of a Ray cluster instead
(rlhf/pipeline/ray_launch.py): same `rank_main`, a scratch folder per node, artifacts through the store.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from collections import deque
from pathlib import Path

from rlhf.core.config import LaunchConfig
from rlhf.core.models import resolve_model
from rlhf.core import tracking
from rlhf.core.dist import NODE_ENV
from rlhf.core.stage import StageContext, StageResult
from rlhf.pipeline.rank import LaunchError, importable_path, launch_spec, rank_main, seeded_run


def check_launch(stage: str, launch: LaunchConfig) -> None:
    """Refuse, before any process starts, a strategy this worker cannot run."""
    import torch

    if launch.strategy != "ddp" and not torch.cuda.is_available():
        raise LaunchError(f"{stage}.launch.strategy: {launch.strategy!r} needs CUDA GPUs; this worker has none (use 'ddp')")
    if launch.strategy == "deepspeed_zero3" and importlib.util.find_spec("deepspeed") is None:
        raise LaunchError(f"{stage}.launch.strategy: 'deepspeed_zero3' needs the deepspeed package on the worker")
    per_node = launch.processes // launch.nnodes
    if torch.cuda.is_available() and torch.cuda.device_count() < per_node:
        raise LaunchError(f"{stage}.launch.processes: {per_node} processes on this node but {torch.cuda.device_count()} GPUs here")


def run_stage(module, stage_cfg, ctx: StageContext) -> StageResult:
    launch: LaunchConfig | None = getattr(stage_cfg, "launch", None)
    if launch is None or (launch.processes == 1 and launch.backend == "torchrun"):
        return seeded_run(module, stage_cfg, ctx)
    spec = launch_spec(ctx.cfg, ctx.stage, ctx.key, ctx.inputs)
    if launch.backend == "ray":  # the cluster's nodes check their own devices
        from rlhf.pipeline.ray_launch import run_on_ray

        with tracking.current().handoff():
            return StageResult(**run_on_ray(ctx, launch, spec))
    check_launch(ctx.stage, launch)
    resolve_model(ctx.cfg.model)  # builds the local copy of the base model once, not once per rank
    with tracking.current().handoff():
        rc, folder, tail = torchrun(spec, launch, ctx.workdir, 0, ctx.log)
    result_path = folder / "result.json"
    if rc != 0 or not result_path.exists():
        errors = [f"{p.stem.removeprefix('error-')}: {p.read_text()}" for p in sorted(folder.glob("error-rank*.txt"))]
        cause = "; ".join(errors) if errors else "last lines:\n" + "\n".join(tail)
        raise LaunchError(f"stage {ctx.stage!r}: {launch.processes} {launch.strategy} processes exited with code {rc}: {cause}")
    return StageResult(**json.loads(result_path.read_text()))


def torchrun(spec: dict, launch: LaunchConfig, workdir: Path, node_rank: int, log) -> tuple[int, Path, deque]:
    """Starts this node's share of the ranks under torchrun and relays their output to `log`; returns the
    exit code, the launch folder (spec, result, error files) and the last lines. One node: `--standalone`.
    Several: node `node_rank` of `launch.nnodes`, static rendezvous at `launch.rendezvous`, ranks
    node_rank x per_node ... in order (so global rank 0, which writes the result, is on node 0), and a
    scratch folder per node (`nodes/<node_rank>`), as on separate machines."""
    per_node = launch.processes // launch.nnodes
    if launch.nnodes > 1:
        workdir = workdir / "nodes" / str(node_rank)
        host, port = launch.rendezvous.rsplit(":", 1)
        where = [f"--nnodes={launch.nnodes}", f"--node_rank={node_rank}", f"--master_addr={host}", f"--master_port={port}"]
    else:
        where = ["--standalone"]
    folder = workdir / "launch"
    folder.mkdir(parents=True, exist_ok=True)
    for stale in (folder / "result.json", *folder.glob("error-rank*.txt")):
        stale.unlink(missing_ok=True)
    (folder / "spec.json").write_text(json.dumps({**spec, "workdir": str(workdir), "result": str(folder / "result.json")}))
    cmd = [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={per_node}",
           "-m", "rlhf.pipeline.launch", str(folder / "spec.json")]
    log.info("%s: launching %d of %d processes (%s) on node %d of %d", spec["stage"], per_node, launch.processes,
             launch.strategy, node_rank, launch.nnodes)
    # One thread per rank on CPU: N ranks each using every core would oversubscribe the machine.
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // per_node)))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": importable_path()}
    if launch.nnodes > 1:
        env[NODE_ENV] = str(node_rank)
    tail: deque[str] = deque(maxlen=30)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        try:
            for line in proc.stdout:
                tail.append(line.rstrip())
                log.info("%s", line.rstrip())
        except BaseException:  # a stop signal (SystemExit) here: torchrun passes SIGTERM on to its ranks
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        rc = proc.wait()
    return rc, folder, tail


def _worker(spec_path: str) -> None:
    """A torchrun rank: the spec and the result travel as files in the stage's scratch."""
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = rank_main(spec)
    except BaseException as e:  # the parent names the root cause, not torchrun's summary of signals
        rank = os.environ.get("RANK", "0")
        (Path(spec["workdir"]) / "launch" / f"error-rank{rank}.txt").write_text(f"{type(e).__name__}: {e}")
        raise
    if result is not None:
        out = Path(spec["result"])
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(out)  # whole or absent: the parent never reads half a result


if __name__ == "__main__":
    _worker(sys.argv[1])
