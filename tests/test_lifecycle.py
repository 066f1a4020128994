"""The life of an `rlhf run` process, run as a user runs it (the console command in a subprocess): it
stops within seconds on SIGTERM or SIGINT wherever it is, leaving no process and no lock behind; every
server it reaches is probed with a timeout before any work; `rlhf down` will not pull the Prefect server
out from under a live run; a run whose Prefect server dies ends with one line and resumes later."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import CONFIG, REPO, cmdline, only, run_cli
from rlhf.core import cluster
from rlhf.core.config import StorageConfig
from rlhf.core.store import endpoint_problem
from rlhf.cli.main import EXIT_API_LOST

EXE = str(Path(sys.executable).parent / "rlhf")


def no_api_env() -> dict:
    """The environment without a Prefect server: the run starts its own temporary one."""
    return {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def start_run(name: str, store: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    args = [EXE, "run", "--profile", "tiny", "--run-name", name, "--set", f"storage.url={store}"]
    for o in [*only("sft"), *overrides]:
        args += ["--set", o]
    return subprocess.Popen(args, cwd=REPO, env=env or no_api_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def wait_until(predicate, run: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if run.poll() is not None:
            raise AssertionError(f"the run ended (exit {run.returncode}) before {what}:\n{run.stdout.read()[-3000:]}")
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def running(procs: list[psutil.Process]) -> list[str]:
    """Those still running (a zombie runs nothing: it waits for whoever inherited it to reap it)."""
    out = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(cmdline(p)[:120])
        except psutil.Error:
            pass
    return out


def stop_and_time(run: subprocess.Popen, sig: int) -> tuple[float, str, list[psutil.Process]]:
    """Signal the run; (seconds until it exited, its output, the processes it had started)."""
    started = psutil.Process(run.pid).children(recursive=True)
    t0 = time.monotonic()
    run.send_signal(sig)
    out, _ = run.communicate(timeout=60)
    return time.monotonic() - t0, out, started


def gone(started: list[psutil.Process], within: float = 10.0) -> list[str]:
    deadline = time.time() + within
    while (alive := running(started)) and time.time() < deadline:
        time.sleep(0.2)
    return alive


def checkpoint_landed(store: Path, run: str, stage: str = "sft"):
    return lambda: any((store / run / stage / "checkpoints").glob("*/.complete"))


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_killed_run_leaves_no_process_behind(tmp_path, sig):
    """`rlhf run` killed while its temporary Prefect server starts: every process it started goes too (the
    flow runs in a child that the kernel signals when the parent dies), and the run lock is released."""
    run = start_run("killed", tmp_path)
    parent = psutil.Process(run.pid)
    wait_until(lambda: any("uvicorn" in cmdline(p) for p in parent.children(recursive=True)), run,
               "the temporary server", timeout=120)
    started = parent.children(recursive=True)
    assert len(started) >= 2  # the flow process and the server, at least
    run.send_signal(getattr(signal, sig))
    run.wait(timeout=60)
    assert not gone(started, within=60)
    assert not (tmp_path / "killed" / "_lock.json").exists()


@pytest.mark.slow  # a tiny SFT run under a temporary Prefect server, twice
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_signal_during_a_stage_stops_the_run_within_seconds_and_a_rerun_resumes(tmp_path, sig, code):
    """SIGTERM (a process manager, `timeout`) or SIGINT (Ctrl-C) mid-stage, after a checkpoint landed."""
    steps = ["sft.max_steps=120", "sft.save_steps=4"]  # about 12 s of steps: stopped after the first checkpoint
    run = start_run("stopped", tmp_path, *steps)
    wait_until(checkpoint_landed(tmp_path, "stopped"), run, "an SFT checkpoint")
    seconds, out, started = stop_and_time(run, sig)
    assert run.returncode == code and seconds < 10, (run.returncode, seconds, out[-2000:])
    assert "Traceback" not in out, out[-3000:]
    assert not gone(started) and not (tmp_path / "stopped" / "_lock.json").exists()
    assert not (tmp_path / "stopped" / "sft" / "manifest.json").exists()  # not complete: resumable
    if sig != signal.SIGTERM:
        return  # the resume is the same after either signal
    rerun = start_run("stopped", tmp_path, *steps)
    out, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0 and "sft: resumed" in out, out[-3000:]


def test_sigterm_while_a_probe_waits_on_a_silent_address_stops_at_once(tmp_path):
    """A Ray address where something accepts connections and never answers: the cluster probe's child
    process waits (bounded by its own timeout); SIGTERM ends the run and that child at once."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # completes TCP handshakes from its backlog, says nothing
        addr = f"127.0.0.1:{silent.getsockname()[1]}"
        run = start_run("probed", tmp_path, "sft.launch.backend=ray", f"sft.launch.ray.address={addr}")
        parent = psutil.Process(run.pid)
        wait_until(lambda: any("rlhf.core.cluster" in cmdline(p) for p in parent.children(recursive=True)), run,
                   "the cluster probe", timeout=120)
        seconds, out, started = stop_and_time(run, signal.SIGTERM)
    assert run.returncode == 143 and seconds < 10, (run.returncode, seconds, out[-2000:])
    assert not gone(started) and "Traceback" not in out
    assert not (tmp_path / "probed").exists()  # refused before anything was written, a lock neither


def test_probes_fail_within_their_timeout_naming_the_address():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        addr = f"127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        why = cluster.alive_nodes(addr, timeout=2)
        assert time.monotonic() - t0 < 4
        assert why == f"something answers at {addr}, but no Ray head joined within 2 s (is it a Ray GCS port?)"
        t0 = time.monotonic()  # an S3 endpoint that accepts and never answers HTTP
        why = endpoint_problem(StorageConfig(url="s3://bucket/x", endpoint_url=f"http://{addr}/path"), timeout=1)
        assert time.monotonic() - t0 < 3 and why.startswith(f"storage: no S3 endpoint answers at http://{addr} "
                                                            "(from storage.endpoint_url) within 1 s")
    with socket.socket() as s:  # nothing listens there once this socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    why = endpoint_problem(StorageConfig(url="s3://bucket/x", endpoint_url=f"http://127.0.0.1:{port}"), timeout=1)
    assert why.startswith(f"storage: no S3 endpoint answers at http://127.0.0.1:{port}") and "refused" in why
    assert endpoint_problem(StorageConfig(url="/tmp/local"), timeout=1) is None


def test_cli_refuses_an_unreachable_s3_endpoint_before_anything(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_cli("run", "-c", str(CONFIG), "--profile", "tiny", "--set", "storage.url=s3://bucket/x", "--set",
                   f"storage.endpoint_url=http://127.0.0.1:{port}", env={"AWS_ACCESS_KEY_ID": "k"}, cwd=tmp_path)
    assert proc.returncode == 2 and f"storage: no S3 endpoint answers at http://127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr


SUPERVISED = textwrap.dedent("""
    import os, signal, sys, time
    from rlhf.pipeline.supervise import fork_supervised
    fork_supervised(after=lambda pid: print(f"after {pid}", flush=True), grace=1.0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a child stuck where no Python handler runs
    print(f"child {os.getpid()}", flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("second", [False, True])
def test_a_child_that_does_not_stop_is_killed_after_the_grace_or_a_second_signal(second):
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISED], stdout=subprocess.PIPE, text=True, cwd=REPO)
    child = int(proc.stdout.readline().split()[1])
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    if second:
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)  # Ctrl-C again: at once
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143 and out.strip() == f"after {child}"
    assert time.monotonic() - t0 < (1.0 if second else 3.0)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


STUCK_ON_EXIT = textwrap.dedent("""
    import atexit, os, time
    from rlhf.pipeline.supervise import fork_supervised
    fork_supervised(grace=2.0)
    def stuck_on_the_way_out():
        time.sleep(60)
    atexit.register(stuck_on_the_way_out)  # the signal's SystemExit runs it, and it never returns
    print(f"child {os.getpid()}", flush=True)
    time.sleep(60)
""")


def test_a_stop_that_hangs_says_where_before_the_child_is_killed():
    """The child's stop handler arms faulthandler's watchdog: a second before the parent's SIGKILL every
    thread's stack reaches stderr, so a hung stop (an exit handler, a library's shutdown) names its place."""
    proc = subprocess.Popen([sys.executable, "-c", STUCK_ON_EXIT], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=REPO)
    child = int(proc.stdout.readline().split()[1])
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143 and time.monotonic() - t0 < 4.0, (proc.returncode, out)
    dump, killed = out.index("stuck_on_the_way_out"), out.index(f"no exit within 2 s of the signal: killing the flow process {child}")
    assert "Thread 0x" in out[:dump] and dump < killed, out
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


ORPHANING = textwrap.dedent("""
    import subprocess, time
    from rlhf.pipeline.supervise import fork_supervised
    fork_supervised()
    server = subprocess.Popen(["sleep", "300"])  # started, and not stopped by any exit handler
    print(server.pid, flush=True)
    time.sleep(300)
""")


def test_a_killed_parent_takes_what_the_flow_process_started_and_never_stopped():
    """The parent SIGKILLed (no one left to kill the group): the flow process, stopped by the kernel's
    SIGTERM, kills what remains of its group on the way out. Prefect's temporary server, started just
    before the signal and not yet under the exit handler that stops it, outlived a run this way."""
    proc = subprocess.Popen([sys.executable, "-c", ORPHANING], stdout=subprocess.PIPE, text=True, cwd=REPO)
    server = psutil.Process(int(proc.stdout.readline()))
    flow = psutil.Process(proc.pid).children()
    proc.kill()
    proc.wait(timeout=10)
    assert not gone([server, *flow], within=10)


@pytest.fixture
def services(tmp_path):
    """`rlhf up` in a Prefect home of its own (it sets PREFECT_API_URL in the active profile); `rlhf down
    --force` afterwards in any case."""
    state = tmp_path / "services"
    env = {"PREFECT_HOME": str(tmp_path / "prefect-user"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    up = run_cli("up", "--profile", "tiny", "--state-dir", str(state), env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    api = (state / "api_url").read_text().strip()
    # a line per service started, not Prefect's table and process-pool advice for each of 11 deployments
    assert up.stdout.splitlines() == [f"server: {api} (pid {(state / 'server.pid').read_text()})",
                                      *(f"worker: pool {p!r} (pid {(state / f'worker-{p}.pid').read_text()})" for p in
                                        ("cpu", "gpu")),
                                      "deployments: rlhf/full and rlhf-stage/<stage>; run: prefect deployment run "
                                      "rlhf/full --watch"], up.stdout
    # the active profile names the server, so plain `prefect` commands reach it
    shown = subprocess.run([str(Path(sys.executable).parent / "prefect"), "config", "view"], capture_output=True,
                           text=True, env={**no_api_env(), **env})
    assert f"PREFECT_API_URL='{api}' (from profile)" in shown.stdout, shown.stdout + shown.stderr
    yield state, {**no_api_env(), **env, "PREFECT_API_URL": api}
    run_cli("down", "--force", "--state-dir", str(state), env=env)


@pytest.mark.slow  # `rlhf up` (server and two workers) and three tiny SFT runs against it
def test_down_refuses_under_a_live_run_and_a_dead_api_stops_the_run_with_one_line(services, tmp_path):
    state, env = services
    store = tmp_path / "store"
    # 1. down while a run reports to the server: refused, naming the run; the run completes
    run = start_run("live", store, "sft.max_steps=120", "sft.save_steps=40", env=env)
    wait_until(lambda: json.loads(run_cli("status", "--state-dir", str(state), env=env).stdout)["runs"], run,
               "the run's record")
    refused = run_cli("down", "--state-dir", str(state), env=env)
    assert refused.returncode == 1 and "rlhf down: refused: run 'live' (pid" in refused.stderr, refused.stderr
    assert "rlhf down --force" in refused.stderr and (state / "server.pid").exists()
    out, _ = run.communicate(timeout=600)
    assert run.returncode == 0 and "sft: ran" in out, out[-3000:]
    assert json.loads(run_cli("status", "--state-dir", str(state), env=env).stdout)["runs"] == []

    # 2. the server killed mid-stage: one line, exit 75 within 30 s, no traceback, lock released; a rerun resumes
    steps = ["sft.max_steps=120", "sft.save_steps=4"]
    run = start_run("lost", store, *steps, env=env)
    wait_until(checkpoint_landed(store, "lost"), run, "an SFT checkpoint")
    started = psutil.Process(run.pid).children(recursive=True)
    os.kill(int((state / "server.pid").read_text()), signal.SIGKILL)
    t0 = time.monotonic()
    out, _ = run.communicate(timeout=120)
    assert run.returncode == EXIT_API_LOST and time.monotonic() - t0 < 30, (run.returncode, out[-2000:])
    lines = [line for line in out.splitlines() if "stopped answering" in line]
    assert len(lines) == 1 and lines[0].startswith("rlhf run: the Prefect API at http://127.0.0.1:"), out[-2000:]
    assert "during stage 'sft'" in lines[0] and "--run-name lost" in lines[0] and "Traceback" not in out, out[-3000:]
    assert not gone(started) and not (store / "lost" / "_lock.json").exists()
    up = run_cli("up", "--profile", "tiny", "--state-dir", str(state), env=env)  # a new server
    assert up.returncode == 0, up.stderr
    env["PREFECT_API_URL"] = (state / "api_url").read_text().strip()
    rerun = start_run("lost", store, *steps, env=env)
    out, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0 and "sft: resumed" in out, out[-3000:]

    # 3. down --force: stops the live run first (as Ctrl-C would), then the services
    run = start_run("forced", store, *steps, env=env)
    wait_until(checkpoint_landed(store, "forced"), run, "an SFT checkpoint")
    forced = run_cli("down", "--force", "--state-dir", str(state), env=env)
    assert forced.returncode == 0 and "stopping run 'forced'" in forced.stdout, forced.stdout + forced.stderr
    out, _ = run.communicate(timeout=60)
    assert run.returncode == 143 and "Traceback" not in out, out[-3000:]
    assert not (store / "forced" / "_lock.json").exists() and not list(state.glob("*.pid"))
