"""A Ray cluster as a launch target (`<stage>.launch.backend: ray`): its address, the bundles a stage
reserves, and whether the cluster can place them. Checked at load time, before anything is written; the
launcher itself is rlhf/pipeline/ray_launch.py."""

from __future__ import annotations

import logging
import os
import re
import socket

from rlhf.core.config import LaunchConfig, PipelineConfig, RayLaunch
from rlhf.core.registry import NAMES


def address(ray_cfg: RayLaunch, env: dict | None = None) -> str | None:
    """host:port of the cluster: the config's, else RAY_ADDRESS."""
    env = os.environ if env is None else env
    return ray_cfg.address or env.get("RAY_ADDRESS") or None


def address_problem(addr: str | None, timeout: float = 3.0) -> str | None:
    """Why no Ray head answers at `addr` (a TCP connection to its GCS port), or None."""
    if not addr:
        return "no Ray address: set launch.ray.address or RAY_ADDRESS (host:port of the head)"
    host, _, port = addr.rpartition(":")
    if not re.fullmatch(r"[A-Za-z0-9.-]+", host) or not port.isdigit():  # from RAY_ADDRESS: not echoed
        return "the Ray address (RAY_ADDRESS) is not host:port of the cluster's head (ray:// client URLs and 'auto' are not supported)"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return None
    except OSError as e:
        return f"no Ray cluster answers at {addr} ({e.strerror or e})"


def _bundle(cpus: float, gpus: int) -> dict[str, float]:
    return {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})}


def actor_bundles(launch: LaunchConfig) -> list[tuple[str, dict[str, float]]]:
    """The RL loop's actors with bundles of their own, in placement order after the ranks: the rollout
    engine (launch.ray.engine: own), then the frozen scorers (launch.ray.scorers: own)."""
    r = launch.ray
    return ([("engine", _bundle(r.engine_cpus, r.engine_gpus))] if r.engine == "own" else []) + (
        [("scorers", _bundle(r.scorer_cpus, r.scorer_gpus))] if r.scorers == "own" else [])


def bundles(launch: LaunchConfig) -> list[dict[str, float]]:
    """One bundle per rank (its CPUs and GPUs), then one per actor of `actor_bundles`."""
    r = launch.ray
    return [_bundle(r.cpus_per_rank, r.gpus_per_rank) for _ in range(launch.processes)] + [b for _, b in actor_bundles(launch)]


def describe(launch: LaunchConfig) -> str:
    """What `rlhf validate` shows: '2 x {CPU: 1.0} (PACK)', or '1 x {CPU: 1.0} + engine {CPU: 2.0} (SPREAD)'."""
    def show(b: dict) -> str:
        return "{" + ", ".join(f"{k}: {v}" for k, v in b.items()) + "}"

    actors = "".join(f" + {role} {show(b)}" for role, b in actor_bundles(launch))
    return f"{launch.processes} x {show(bundles(launch)[0])}{actors} ({launch.ray.strategy})"


def unplaceable(want: list[dict[str, float]], nodes: list[dict[str, float]], strategy: str) -> str | None:
    """Why `want` cannot be placed on nodes with these free resources, or None. STRICT_SPREAD needs a node
    per bundle; the others may pack several bundles on a node (first fit, largest node first; a sufficient
    test, as Ray's own placement is). Hand-worked: two {CPU: 1} bundles on one node of 2 CPUs fit with
    PACK and not with STRICT_SPREAD."""
    def fits(bundle, free):
        return all(free.get(k, 0.0) >= v for k, v in bundle.items())

    totals = {k: sum(n.get(k, 0.0) for n in nodes) for k in {k for b in want for k in b}}
    for k, total in sorted(totals.items()):
        need = sum(b.get(k, 0.0) for b in want)
        if need > total:
            return f"needs {need:g} {k} in all, the cluster has {total:g}"
    if strategy == "STRICT_SPREAD":
        if all(b == want[0] for b in want):
            usable = sum(1 for n in nodes if fits(want[0], n))
            return None if usable >= len(want) else (
                f"STRICT_SPREAD needs {len(want)} nodes that each fit {want[0]}, the cluster has {usable}")
        # a node per bundle, largest bundle first, each on the smallest free node that fits it
        free = sorted(nodes, key=lambda n: sum(n.values()))
        for i in sorted(range(len(want)), key=lambda i: -sum(want[i].values())):
            node = next((n for n in free if fits(want[i], n)), None)
            if node is None:
                return f"STRICT_SPREAD: bundle {i} ({want[i]}) fits on no node the other bundles leave free"
            free.remove(node)
        return None
    free = sorted((dict(n) for n in nodes), key=lambda n: -sum(n.values()))
    for i, bundle in enumerate(want):
        node = next((n for n in free if fits(bundle, n)), None)
        if node is None:
            return f"bundle {i} ({bundle}) fits on no node with what the other bundles leave"
        for k, v in bundle.items():
            node[k] -= v
    return None


def cluster_problem(launch: LaunchConfig) -> str | None:
    """Connects to the cluster and says why it cannot place this stage's bundles, or why it could not connect
    (None: it can place them)."""
    import ray

    connected_here = not ray.is_initialized()
    if connected_here:
        try:
            ray.init(address=address(launch.ray), logging_level=logging.WARNING, log_to_driver=False)
        except Exception as e:  # Ray raises ConnectionError, RuntimeError, AuthenticationError...
            first = (str(e).strip().splitlines() or [""])[0][:300]
            return (f"could not join the cluster at {address(launch.ray)} as a Ray client ({type(e).__name__}: {first}); "
                    "a head with token authentication (as `rlhf up --ray` starts) also needs RAY_AUTH_MODE=token "
                    "and RAY_AUTH_TOKEN_PATH (or RAY_AUTH_TOKEN)")
    try:
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    finally:
        if connected_here:
            ray.shutdown()
    why = unplaceable(bundles(launch), nodes, launch.ray.strategy)
    return why and f"the cluster at {address(launch.ray)} cannot place {describe(launch)}: {why}"


def ray_stages(cfg: PipelineConfig) -> dict[str, LaunchConfig]:
    """Enabled stages whose ranks go to a Ray cluster."""
    out = {}
    for name in NAMES:
        st = cfg.stage(name)
        launch = getattr(st, "launch", None)
        if getattr(st, "enabled", True) and launch is not None and launch.backend == "ray":
            out[name] = launch
    return out


def launch_problems(cfg: PipelineConfig, reachability: bool = True) -> list[str]:
    """'<stage>.launch...' lines for Ray launches this machine cannot start (checked before any work)."""
    import importlib.util

    stages = ray_stages(cfg)
    if not stages:
        return []
    if importlib.util.find_spec("ray") is None:
        return [f"{s}.launch.backend: 'ray' needs the ray package, which is not installed: pip install ray==2.60.0 "
                "(or the [ray] extra)" for s in stages]
    out = []
    for name, launch in stages.items():
        if not address(launch.ray):
            out.append(f"{name}.launch.ray.address: not set: set it or RAY_ADDRESS (host:port of the cluster's head)")
        elif not reachability:
            continue
        elif why := address_problem(address(launch.ray)):
            out.append(f"{name}.launch.ray.address: {why}")
        elif why := cluster_problem(launch):
            out.append(f"{name}.launch.ray: {why}")
    return out
