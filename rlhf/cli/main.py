"""The `rlhf` command. Bad configuration exits 2 with one 'key.path: problem' line per problem,
before anything heavy (torch, models, Prefect) is imported."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml

from rlhf.core.loader import ConfigError, derived_quantities, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Resumable RLHF pipeline.")

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="pipeline.yaml to read")]
ProfileOpt = Annotated[str, typer.Option("--profile", "-p", help="profile in the file's `profiles:` (default, tiny, ...)")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="override: key.path=value (YAML value); repeatable")]


@contextmanager
def _bad_input_exits_2():
    """A config or data problem: its message on stderr and exit 2, before anything expensive."""
    from rlhf.data.userdata import DataError

    try:
        yield
    except (ConfigError, DataError) as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None


def _load_or_exit(config: Path, profile: str, overrides: list[str], preflight: bool = False):
    """The config and its stage plan; exit 2 on a problem. Preflight also asks every server the run will
    reach (S3, tracking, Ray) whether it answers, each within a timeout. The data files' row check is
    `_data_lines_or_exit`, apart: `run` needs it only when a stage will run."""
    with _bad_input_exits_2():
        cfg = load_config(config, profile, overrides)
        from rlhf.core.registry import plan

        stages = plan(cfg)
        if preflight:
            from rlhf.core.store import ArtifactStore
            from rlhf.pipeline.preflight import network_problems, policy_problems

            if problems := network_problems(cfg) or policy_problems(cfg, ArtifactStore(cfg.storage)):
                raise ConfigError(str(config), problems)
    return cfg, stages


def _data_lines_or_exit(cfg) -> list[str]:
    """The prompts' and user data files' row check as summary lines; exit 2 on a problem."""
    from rlhf.pipeline.preflight import check_data

    with _bad_input_exits_2():
        return check_data(cfg)


@app.command()
def validate(
    config: ConfigOpt = Path("pipeline.yaml"),
    profile: ProfileOpt = "default",
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Check pipeline.yaml and the user data files; print the resolved config, the stage plan, derived
    batch quantities and the preflight (skip/resume/run per stage, memory estimate, warnings)."""
    cfg, stages = _load_or_exit(config, profile, set_ or [], preflight=True)
    data_lines = _data_lines_or_exit(cfg)
    from rlhf.pipeline import preflight
    from rlhf.core.store import ArtifactStore

    report = {
        "config": cfg.model_dump(mode="json"),
        "data": data_lines,
        "plan": stages,
        "derived": derived_quantities(cfg),
        "preflight": preflight.report(cfg, ArtifactStore(cfg.storage)),
    }
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    for line in data_lines:
        typer.echo(line)
    typer.echo(yaml.safe_dump(report["config"], sort_keys=False).rstrip())
    typer.echo(f"\n# plan (DAG order): {' -> '.join(stages) or '(no stage enabled)'}")
    for stage, values in report["derived"].items():
        typer.echo(f"# {stage}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    typer.echo(f"# preflight for run {cfg.run.name!r} (memory: estimated peak per stage, see rlhf/pipeline/memory.py)")
    for line in report["preflight"]:
        typer.echo(f"# {line}")
    typer.echo(f"# {config}: OK")


@app.command()
def run(
    config: ConfigOpt = Path("pipeline.yaml"),
    profile: ProfileOpt = "default",
    run_name: Annotated[Optional[str], typer.Option("--run-name", help="overrides run.name")] = None,
    set_: SetOpt = None,
) -> None:
    """Run the enabled stages through the `rlhf` Prefect flow (a temporary local API unless
    PREFECT_API_URL points at a server). Completed stages with unchanged content keys are skipped.
    SIGINT (Ctrl-C) or SIGTERM stops it within seconds wherever it is; a rerun resumes."""
    import signal

    from rlhf.pipeline.supervise import STOPS, exit_on_signal, fork_supervised

    for sig in STOPS:  # during preflight: SystemExit, which also ends a probe's child process
        signal.signal(sig, exit_on_signal)
    # JSON-quoted: a YAML double-quoted string, so `123` or `2024-01-01` stay names, and "" is refused, not ignored.
    overrides = list(set_ or []) + ([f"run.name={json.dumps(run_name)}"] if run_name is not None else [])
    # the data files' check comes after the skip test below: when every key is unchanged, the data was
    # accepted by the run that wrote them, and generating the task's prompts was half of a skipped rerun's 2.3 s
    cfg, stages = _load_or_exit(config, profile, overrides, preflight=True)
    from rlhf.pipeline.lock import RunLock, RunLocked
    from rlhf.core.store import ArtifactStore, StorageError

    try:  # asked again, atomically enough, when the flow takes the lock; here to refuse before Prefect starts
        RunLock(ArtifactStore(cfg.storage), cfg.run.name).check()
    except RunLocked as e:
        typer.echo(f"refused: {e}", err=True)
        raise typer.Exit(3) from None
    except StorageError as e:
        typer.echo(f"storage: {e}", err=True)
        raise typer.Exit(2) from None
    # The temporary local API needs no telemetry (and there is no network to send it to).
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect waits 20 s for it to start; on a busy 2-core machine (the test suite's parallel workers)
    # it can take longer, and the run would fail before its first stage.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    store = ArtifactStore(cfg.storage)
    from rlhf.pipeline.preflight import nothing_to_run

    if (complete := nothing_to_run(cfg, store)) is not None:
        for summary in complete:
            _print_summary({**summary, "status": "skipped"})
        typer.echo(f"run {cfg.run.name!r}: every stage is complete under its content key; nothing to run "
                   f"(no Prefect flow run started). Results: {store.url(store.path(cfg.run.name))}")
        return
    for line in _data_lines_or_exit(cfg):
        typer.echo(line)
    for stage, values in derived_quantities(cfg).items():
        typer.echo(f"{stage}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    # before Prefect and torch start threads: the flow runs in a child that dies with us
    fork_supervised(after=lambda pid: RunLock(store, cfg.run.name).release_for(pid))
    from prefect.settings import PREFECT_API_URL

    from rlhf.pipeline import liveruns

    if api := PREFECT_API_URL.value():  # a server we did not start (`rlhf up`'s): it can go away under us
        liveruns.watch(api, lambda why: _api_lost(api, why, cfg.run.name))
    from flows.rlhf_flow import rlhf

    try:
        results = rlhf(config_path=str(config.resolve()), profile=profile, overrides=overrides)
    except RunLocked as e:
        typer.echo(f"refused: {e}", err=True)
        raise typer.Exit(3) from None
    for r in results:
        _print_summary(r)


def _print_summary(r: dict) -> None:
    shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in r["metrics"].items()}
    typer.echo(f"{r['stage']:>14}: {r['status']:<8} key {r['key'][:12]}  {shown}")


EXIT_API_LOST = 75  # sysexits.h EX_TEMPFAIL: a temporary failure, worth running again


def _api_lost(api: str, why: str, run: str) -> None:
    """Called from the API watch thread: ends the run now, with one line. Going through Prefect instead
    would take minutes: its clients retry every state change, log batch and event against the dead server,
    at interpreter exit too. Nothing is lost: every point of a stage is resumable, the parent process
    releases the run lock and ends what this process started."""
    import logging
    import shlex

    from rlhf.core import progress
    from rlhf.core.net import shown

    logging.getLogger("prefect").setLevel(logging.CRITICAL + 1)  # its retry warnings say nothing more than this line
    stage = progress.current_stage()
    typer.echo(f"rlhf run: the Prefect API at {shown(api)} stopped answering ({why})"
               f"{f' during stage {stage!r}' if stage else ''}; run {run!r} stopped, and its finished stages and "
               f"checkpoints are kept: once the API is back (`rlhf up`), `{shlex.join(['rlhf', *sys.argv[1:]])}` "
               "resumes it", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_API_LOST)


@app.command()
def join(
    stage: Annotated[str, typer.Option("--stage", help="the stage whose ranks this node runs")],
    node_rank: Annotated[int, typer.Option("--node-rank", help="this node's index, 1 .. launch.nnodes - 1")],
    config: ConfigOpt = Path("pipeline.yaml"),
    profile: ProfileOpt = "default",
    set_: SetOpt = None,
) -> None:
    """Run this machine's share of a multi-node torchrun stage (`<stage>.launch.nnodes` > 1): the stage's
    worker is node 0 and waits at `launch.rendezvous` for the others. Same config as the run; its inputs
    must be complete in the store. Exits with the ranks' exit code."""
    cfg, _ = _load_or_exit(config, profile, list(set_ or []))
    from rlhf.core.registry import NAMES

    if stage not in NAMES:
        typer.echo(f"--stage: {stage!r} is not a stage; one of {', '.join(NAMES)}", err=True)
        raise typer.Exit(2)
    launch = getattr(cfg.stage(stage), "launch", None)
    if launch is None or launch.nnodes < 2:
        typer.echo(f"{stage}.launch.nnodes: `rlhf join` is for a stage launched on several nodes (nnodes > 1)", err=True)
        raise typer.Exit(2)
    if not 1 <= node_rank < launch.nnodes:
        typer.echo(f"--node-rank: must be 1 .. {launch.nnodes - 1} (node 0 is the stage's worker), got {node_rank}", err=True)
        raise typer.Exit(2)
    import logging

    from rlhf.core.manifest import ManifestError
    from rlhf.core.store import ArtifactMissing, ArtifactStore, StorageError
    from rlhf.pipeline.launch import torchrun
    from rlhf.pipeline.rank import launch_spec
    from rlhf.pipeline.runner import stage_identity, stage_workdir

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        inputs, key = stage_identity(cfg, stage, ArtifactStore(cfg.storage))
    except (ArtifactMissing, ManifestError, StorageError) as e:  # node 0 needs them as much as this node does
        typer.echo(f"{stage}: its inputs are not complete in the store: {e}", err=True)
        raise typer.Exit(2) from None
    rc, _, _ = torchrun(launch_spec(cfg, stage, key, inputs), launch, stage_workdir(cfg, stage, key), node_rank, logging.getLogger(f"rlhf.{stage}"))
    raise typer.Exit(rc)


StateOpt = Annotated[Optional[Path], typer.Option("--state-dir", help="where up/down/status keep PIDs and logs")]


@app.command()
def up(config: ConfigOpt = Path("pipeline.yaml"), profile: ProfileOpt = "default", set_: SetOpt = None,
       state_dir: StateOpt = None, poll_seconds: int = 5,
       heartbeat_seconds: Annotated[int, typer.Option(min=30, help="flow-run heartbeat; a run silent for "
                                                      "2x this + 15 s is marked Crashed")] = 30,
       ray: Annotated[bool, typer.Option("--ray", help="also start a one-node Ray head on 127.0.0.1 for stages "
                                         "with launch.backend: ray (workers get its RAY_ADDRESS)")] = False) -> None:
    """Start a local Prefect server, a process worker per work pool, and register the deployments.
    Run again to restart workers that died; what is healthy is kept. With tracking.backends: [mlflow] and a
    127.0.0.1/localhost tracking.mlflow.uri, an MLflow server there too; with --ray, a local Ray head."""
    cfg, _ = _load_or_exit(config, profile, set_ or [])  # no probes: up starts the tracking server
    from rlhf.cli import services

    try:
        services.up(cfg, config, services.state_dir(state_dir and str(state_dir)), poll_seconds, heartbeat_seconds,
                    log=typer.echo, ray=ray)
    except RuntimeError as e:  # a service that would not start: its log is named in the message
        typer.echo(f"rlhf up: {e}", err=True)
        raise typer.Exit(1) from None


@app.command()
def deploy(config: ConfigOpt = Path("pipeline.yaml"), profile: ProfileOpt = "default", set_: SetOpt = None,
           source: Annotated[Optional[str], typer.Option(help="where workers find this code: a path in their "
                                                          "image or a git URL (default: this checkout)")] = None,
           heartbeat_seconds: Annotated[int, typer.Option(min=30)] = 30) -> None:
    """Register `rlhf/full`, `rlhf-stage/<stage>` and the crash-detection automation on the server that
    PREFECT_API_URL names (a cluster's), without starting anything locally. Workers need
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY set to the same heartbeat."""
    cfg, _ = _load_or_exit(config, profile, set_ or [])
    from flows.rlhf_flow import deploy as register

    register(cfg.model_dump(mode="json"), str(config.resolve()), heartbeat_seconds, source)
    typer.echo(f"registered rlhf/full and rlhf-stage/<stage> on {os.environ.get('PREFECT_API_URL', 'the active profile')}")


@app.command()
def down(state_dir: StateOpt = None,
         force: Annotated[bool, typer.Option("--force", help="stop the runs that report to the server first "
                                             "(as Ctrl-C would: the same command resumes them)")] = False) -> None:
    """Stop the workers, then the server, that `rlhf up` started (by their recorded PIDs). Refused (exit 1)
    while runs report to that server, unless --force."""
    from rlhf.cli import services

    try:
        services.down(services.state_dir(state_dir and str(state_dir)), log=typer.echo, force=force)
    except services.RunsLive as e:
        typer.echo(f"rlhf down: {e}", err=True)
        raise typer.Exit(1) from None


@app.command()
def status(state_dir: StateOpt = None) -> None:
    """Show the server URL and whether each process `rlhf up` started is alive."""
    from rlhf.cli import services

    typer.echo(json.dumps(services.status(services.state_dir(state_dir and str(state_dir))), indent=2))


# A query may start with `--` (an SQL comment): unknown option-like words are the SQL argument, not options.
@app.command(context_settings={"ignore_unknown_options": True})
def query(
    sql: Annotated[str, typer.Argument(help="a read-only SQL query over runs, samples, battles, ratings, metrics, accuracy_diffs")],
    config: ConfigOpt = Path("pipeline.yaml"),
    profile: ProfileOpt = "default",
    set_: SetOpt = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="table | csv | json")] = "table",
) -> None:
    """Query evaluation results of every run in the artifact store with DuckDB (read-only)."""
    _check_format(fmt)
    cfg, _ = _load_or_exit(config, profile, set_ or [])
    from rlhf.ops.results import QueryRefused
    from rlhf.ops.results import query as run_query
    from rlhf.core.store import ArtifactStore

    try:
        table = run_query(ArtifactStore(cfg.storage), sql)
    except QueryRefused as e:
        typer.echo(f"query refused: {e}", err=True)
        raise typer.Exit(2) from None
    except Exception as e:  # DuckDB parser/binder errors: show DuckDB's own message
        typer.echo(f"query failed: {e}", err=True)
        raise typer.Exit(1) from None
    show(table, fmt)


def _check_format(fmt: str) -> None:
    if fmt not in ("table", "csv", "json"):
        typer.echo(f"--format: must be one of table, csv, json, got {fmt!r}", err=True)
        raise typer.Exit(2)


def show(table, fmt: str) -> None:
    """A result table as text (aligned columns), CSV or JSON on stdout."""
    rows = table.to_pylist()
    if fmt == "json":
        typer.echo(json.dumps(rows, indent=2, default=str))
    elif fmt == "csv":
        import csv
        import io

        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=table.column_names)
        writer.writeheader()
        writer.writerows(rows)
        typer.echo(buf.getvalue().rstrip())
    else:
        typer.echo(format_table(table.column_names, rows))


@app.command()
def leaderboard(
    config: ConfigOpt = Path("pipeline.yaml"),
    profile: ProfileOpt = "default",
    set_: SetOpt = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="table | csv | json")] = "table",
    rounds: Annotated[int, typer.Option(min=10, max=100_000, help="bootstrap rounds for the intervals")] = 1000,
    judge_model: Annotated[Optional[str], typer.Option(
        "--judge-model", help="also judge by a reward model: <run>/reward_model or model:<hub id or folder>; "
                              "the only judge of open-ended prompt sets")] = None,
) -> None:
    """Rate every policy whose answers the store keeps, across runs and models, on each shared prompt set:
    Elo with 95% intervals, length-controlled Elo, accuracy. Also written to the store for `rlhf query`
    (the `leaderboard` view)."""
    _check_format(fmt)
    cfg, _ = _load_or_exit(config, profile, set_ or [])
    from rlhf.ops.leaderboard import judge_problem

    if judge_model is not None and (problem := judge_problem(judge_model)):
        typer.echo(problem, err=True)
        raise typer.Exit(2)
    from rlhf.core.store import ArtifactStore, StorageError
    from rlhf.ops.leaderboard import build, load_judge

    try:
        store = ArtifactStore(cfg.storage)
        try:
            judge = None if judge_model is None else load_judge(store, judge_model, cfg.model.dtype)
        except (ValueError, OSError) as e:  # a judge that does not exist or does not load as a reward model
            typer.echo(str(e).splitlines()[0][:500], err=True)
            raise typer.Exit(2) from None
        table = build(store, rounds, judge=judge)
    except StorageError as e:
        typer.echo(f"storage: {e}", err=True)
        raise typer.Exit(2) from None
    if judge is not None:
        typer.echo(f"{judge.name}: {judge.counts['scored']} answers scored, {judge.counts['reused']} reused", err=True)
    if table.num_rows == 0:
        typer.echo("no prompt set with answers of two or more policies in the store yet: run an eval first", err=True)
    show(table, fmt)


@app.command()
def report(
    run_name: Annotated[str, typer.Argument(help="the run to report on (its run.name)")],
    config: ConfigOpt = Path("pipeline.yaml"),
    profile: ProfileOpt = "default",
    set_: SetOpt = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="folder for report.md and PNGs")] = None,
) -> None:
    """Write a self-contained report of one run (markdown + PNG curves, Elo chart, leaderboard)."""
    cfg, _ = _load_or_exit(config, profile, [*(set_ or []), f"run.name={json.dumps(run_name)}"])
    from rlhf.ops.report import build
    from rlhf.core.store import ArtifactStore

    store = ArtifactStore(cfg.storage)
    if not store.fs.exists(store.path(cfg.run.name)):
        typer.echo(f"no run {cfg.run.name!r} under {store.url(store.path(cfg.run.name))}", err=True)
        raise typer.Exit(2)
    typer.echo(str(build(store, cfg.run.name, out or Path("reports") / cfg.run.name)))


@app.command()
def diff(
    run_a: Annotated[str, typer.Argument(help="first run name (A)")],
    run_b: Annotated[str, typer.Argument(help="second run name (B)")],
    config: ConfigOpt = Path("pipeline.yaml"),
    profile: ProfileOpt = "default",
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Per stage: do the two runs' results differ, and why (changed config values with old and new,
    code version, an upstream stage's key); final metrics side by side; eval Elo with intervals."""
    cfgs = [_load_or_exit(config, profile, [*(set_ or []), f"run.name={json.dumps(r)}"])[0] for r in (run_a, run_b)]
    from rlhf.ops.diff import diff_runs, render
    from rlhf.ops.results import eval_tables
    from rlhf.core.registry import NAMES
    from rlhf.core.manifest import ManifestError
    from rlhf.core.store import ArtifactStore, StorageError

    store = ArtifactStore(cfgs[0].storage)
    manifests, ratings = {}, {}
    try:
        for cfg in cfgs:
            run = cfg.run.name
            if not store.fs.exists(store.path(run)):
                typer.echo(f"no run {run!r} under {store.url(store.path(run))}", err=True)
                raise typer.Exit(2)
            manifests[run] = {s: m for s in NAMES if isinstance(m := store.read_manifest(run, s), dict)}
            ratings[run] = eval_tables(store, [run], "ratings").to_table().to_pylist() if "eval" in manifests[run] else []
    except StorageError as e:
        typer.echo(f"storage: {e}", err=True)
        raise typer.Exit(2) from None
    except ManifestError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None
    names = [c.run.name for c in cfgs]
    diffs = diff_runs(manifests[names[0]], manifests[names[-1]], list(NAMES))
    if as_json:
        typer.echo(json.dumps({"a": names[0], "b": names[-1], "stages": diffs, "ratings": ratings}, indent=2, default=str))
    else:
        typer.echo(render(names[0], names[-1], diffs, ratings))


def format_table(columns: list[str], rows: list[dict]) -> str:
    def cell(v) -> str:
        return f"{v:.4g}" if isinstance(v, float) else ("NULL" if v is None else str(v))

    cells = [[cell(r[c]) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip(), "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines)


def main() -> None:  # pragma: no cover - console entry point alias
    sys.exit(app())
