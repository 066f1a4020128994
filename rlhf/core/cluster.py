"""A Ray cluster as a launch target (`<stage>.launch.backend: ray`): its address, the bundles a stage
reserves, and whether the cluster can place them. The address is checked at load time (no network), the
cluster by preflight's network probes, before anything is written; the launcher itself is
rlhf/pipeline/ray_launch.py."""

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


def address_syntax_problem(addr: str | None) -> str | None:
    """Why `addr` is not host:port of a Ray head (checked at load time, no network), or None."""
    if not addr:
        return "no Ray address: set launch.ray.address or RAY_ADDRESS (host:port of the head)"
    host, _, port = addr.rpartition(":")
    if not re.fullmatch(r"[A-Za-z0-9.-]+", host) or not port.isdigit():  # from RAY_ADDRESS: not echoed
        return "the Ray address (RAY_ADDRESS) is not host:port of the cluster's head (ray:// client URLs and 'auto' are not supported)"
    return None


def address_problem(addr: str | None, timeout: float = 3.0) -> str | None:
    """Why no Ray head answers at `addr` (a TCP connection to its GCS port, at most `timeout` s), or None."""
    if why := address_syntax_problem(addr):
        return why
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return None
    except OSError as e:
        return f"no Ray cluster answers at {addr} within {timeout:g} s ({e.strerror or e})"


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


PROBE_SECONDS = 30.0  # joining a live head takes 2-5 s on 2 busy cores; a port that is not a Ray head never answers
# ray.init asks a head for its cluster id up to this many times, a second apart, and retries an answer it cannot
# get past too: a head that refuses the client's token took 20 s (Ray's default) to be reported. A live head
# answers the first ask, so 5 tries only shorten the wait for a refusal. The user's own setting wins.
GCS_TRIES = {"RAY_gcs_server_port_wait_time_s": "5"}


def alive_nodes(addr: str, timeout: float = PROBE_SECONDS) -> list[dict[str, float]] | str:
    """The resources of the cluster's live nodes, or why they could not be read. Asked by a short-lived child
    process (`python -m rlhf.core.cluster ADDRESS`): Ray's client keeps gRPC threads that do not survive a
    fork, so the process that runs the flow (a fork of `rlhf run`) must not have joined the cluster, and a
    head that accepts the connection but never answers costs `timeout` seconds, not a hang. The child dies
    with this process (PR_SET_PDEATHSIG) and is killed on timeout or on SIGTERM here (subprocess.run)."""
    import json
    import subprocess
    import sys

    from rlhf.core.proc import die_with_parent

    try:
        done = subprocess.run([sys.executable, "-m", "rlhf.core.cluster", addr], capture_output=True, text=True,
                              timeout=timeout, preexec_fn=die_with_parent,
                              env={**GCS_TRIES, **os.environ, "RAY_ADDRESS": addr})
    except subprocess.TimeoutExpired:
        return f"something answers at {addr}, but no Ray head joined within {timeout:g} s (is it a Ray GCS port?)"
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    if "nodes" in answer:
        return answer["nodes"]
    why = answer.get("error") or (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1][:300]
    return (f"could not join the cluster at {addr} as a Ray client ({why}); a head with token authentication (as "
            "`rlhf up --ray` starts) also needs RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH (or RAY_AUTH_TOKEN)")


def ray_stages(cfg: PipelineConfig) -> dict[str, LaunchConfig]:
    """Enabled stages whose ranks go to a Ray cluster."""
    out = {}
    for name in NAMES:
        st = cfg.stage(name)
        launch = getattr(st, "launch", None)
        if getattr(st, "enabled", True) and launch is not None and launch.backend == "ray":
            out[name] = launch
    return out


def launch_problems(cfg: PipelineConfig) -> list[str]:
    """'<stage>.launch...' lines for Ray launches this machine cannot start, from the config and the installed
    packages alone (load time: no network; the cluster itself is probed by `network_problems`)."""
    import importlib.util

    stages = ray_stages(cfg)
    if stages and importlib.util.find_spec("ray") is None:
        return [f"{s}.launch.backend: 'ray' needs the ray package, which is not installed: pip install ray==2.60.0 "
                "(or the [ray] extra)" for s in stages]
    out = []
    for name, launch in stages.items():
        if not address(launch.ray):
            out.append(f"{name}.launch.ray.address: not set: set it or RAY_ADDRESS (host:port of the cluster's head)")
        elif why := address_syntax_problem(address(launch.ray)):
            out.append(f"{name}.launch.ray.address: {why}")
    return out


def network_problems(cfg: PipelineConfig, timeout: float = 3.0) -> list[str]:
    """'<stage>.launch.ray...' lines for Ray heads that do not answer within `timeout` s, or that answer but
    cannot place the stage's bundles (within PROBE_SECONDS). Stages on the same cluster share one question."""
    out, asked = [], {}
    for name, launch in ray_stages(cfg).items():
        addr = address(launch.ray)
        if why := address_problem(addr, timeout):
            out.append(f"{name}.launch.ray.address: {why}")
            continue
        if addr not in asked:
            asked[addr] = alive_nodes(addr)
        nodes = asked[addr]
        if isinstance(nodes, str):
            out.append(f"{name}.launch.ray: {nodes}")
        elif why := unplaceable(bundles(launch), nodes, launch.ray.strategy):
            out.append(f"{name}.launch.ray: the cluster at {addr} cannot place {describe(launch)}: {why}")
    return out


def _print_alive_nodes(addr: str) -> int:
    """The probe's child process: one JSON line, {"nodes": [...]} or {"error": "..."}."""
    import json

    try:
        import ray

        ray.init(address=addr, logging_level=logging.ERROR, log_to_driver=False)
        try:
            nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        finally:
            ray.shutdown()
    except Exception as e:  # Ray raises ConnectionError, RuntimeError, AuthenticationError...
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(json.dumps({"error": f"{type(e).__name__}: {first}"}), flush=True)
        return 3
    print(json.dumps({"nodes": nodes}), flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_print_alive_nodes(sys.argv[1]))
