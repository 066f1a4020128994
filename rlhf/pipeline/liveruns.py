"""Runs that report to a Prefect API server they did not start (`rlhf up`'s, or a cluster's), and what
happens when that server goes away.

Each such run keeps a record `<RLHF_HOME>/live-runs/<hash of the API URL>/<pid>.json` while it runs, so
`rlhf down` can see the runs that stopping its server would break, and refuse (records of processes that
no longer exist are ignored and removed). A run on a temporary API (the one `rlhf run` starts when no
PREFECT_API_URL is set) has no record: `down` cannot touch its server.

`watch` polls the server's /health from a daemon thread and calls back once when it has stopped answering
for `misses` polls in a row: `rlhf run` then ends the run at once (every point of a stage is resumable:
manifests are written last, checkpoints carry a completion marker) instead of failing through Prefect's
reporting, whose clients retry every call and event against the dead server for minutes.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhf.core.models import home
from rlhf.core.net import http_status


def folder(api: str) -> Path:
    return home() / "live-runs" / hashlib.sha256(api.rstrip("/").encode()).hexdigest()[:16]


def _started(pid: int) -> float | None:
    """The process's start time (seconds since the epoch), or None when there is no such process: with
    the pid, it tells a live run from a later process that reuses the pid."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


@contextmanager
def registered(api: str, run: str, store: str) -> Iterator[Path]:
    """A record of this process's run under `api`'s folder for as long as the block runs."""
    d = folder(api)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{os.getpid()}.json"
    record = {"run": run, "pid": os.getpid(), "host": socket.gethostname(), "api": api, "store": store,
              "process_started": _started(os.getpid()), "started": time.time()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def live(api: str) -> list[dict]:
    """The records of runs that report to `api` and whose process still runs on this host. Records of
    processes that are gone (killed before they could remove them) are deleted; unreadable ones too: the
    folder is ours, and a record that cannot be read names no process to protect."""
    out = []
    for path in sorted(folder(api).glob("*.json")):
        try:
            rec = json.loads(path.read_text())
            pid, began = rec["pid"], rec["process_started"]
            alive = (isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 and rec.get("host") == socket.gethostname()
                     and isinstance(began, (int, float)) and _started(pid) == began)
        except (OSError, ValueError, KeyError, TypeError):
            rec, alive = None, False
        if alive:
            out.append(rec)
        else:
            path.unlink(missing_ok=True)
    return out


def watch(api: str, on_lost: Callable[[str], None], every: float = 2.0, misses: int = 3) -> threading.Thread:
    """Starts a daemon thread that asks GET `api`/health every `every` s (each within `every` s) and calls
    on_lost(why) once, from that thread, after `misses` failures in a row; an answer resets the count."""
    def loop() -> None:
        failed = 0
        while True:
            time.sleep(every)
            status, why = http_status(f"{api.rstrip('/')}/health", timeout=every)
            failed = failed + 1 if status != 200 else 0
            if failed >= misses:
                on_lost(why or f"/health answered HTTP {status}")
                return

    thread = threading.Thread(target=loop, name="rlhf-api-watch", daemon=True)
    thread.start()
    return thread
