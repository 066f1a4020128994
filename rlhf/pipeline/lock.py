"""One live run per run name: a lock object in the artifact store with an owner and a heartbeat.

`<root>/<run>/_lock.json` holds {owner, host, pid, started, heartbeat}. A second launch of the same run
name is refused while the heartbeat is fresh; a lock whose heartbeat is older than `stale_after`
seconds (its run died without releasing it) is taken over, and so, at once, is a lock naming this host
and a process id that no longer exists; every takeover is logged. Different run names never touch each
other's locks.

Every write is atomic and conditional (ArtifactStore.create_json / replace_json / remove_if: a flock of the
folder locally, S3's If-None-Match / If-Match preconditions): of two launches at the same moment exactly one creates the lock,
of two takeovers of the same stale lock exactly one replaces it, and a heartbeat replaces only the version
it wrote last. So a heartbeat that finds another owner's version (its run was taken over), or that the
store keeps refusing for half of `stale_after` (others would soon take it over), stops the run: `on_lost`
logs why and interrupts the main thread (as Ctrl-C does; `rlhf run` turns that into a clean stop).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timezone

from rlhf.core.store import ArtifactStore, StorageError

LOCK = "_lock.json"
log = logging.getLogger("rlhf.pipeline.lock")


class RunLocked(RuntimeError):
    pass


def _now() -> float:
    return time.time()


def _interrupt_main(why: str) -> None:
    """The default on_lost: log the reason, then interrupt the main thread as Ctrl-C would."""
    import _thread

    log.error("%s", why)
    _thread.interrupt_main()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


class RunLock:
    def __init__(self, store: ArtifactStore, run: str, stale_after: float = 120.0, heartbeat_every: float = 20.0,
                 on_lost=None):
        self.store, self.run = store, run
        self.path = store.path(run, LOCK)
        self.stale_after, self.heartbeat_every = stale_after, heartbeat_every
        self.on_lost = on_lost or _interrupt_main
        self.owner = uuid.uuid4().hex
        self._tag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self, started: float) -> dict:
        return {"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(), "started": started,
                "heartbeat": _now()}

    def _refusal(self, current: dict) -> RunLocked:
        started = current.get("started")
        since = datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds") if isinstance(
            started, (int, float)) and not isinstance(started, bool) and 0 <= started < 1e11 else "?"
        return RunLocked(
            f"run {self.run!r} is already running (host {str(current.get('host'))[:64]}, pid "
            f"{str(current.get('pid'))[:12]}, since {since}); pick another --run-name, or wait: a lock without "
            f"heartbeat for {self.stale_after:.0f} s is taken over"
        )

    def check(self) -> None:
        """Raises RunLocked if a live run holds this name; takes nothing. `rlhf run` asks before it starts
        Prefect, so a refused launch prints one line instead of a crashed flow run's traceback."""
        current, _ = self.store.read_json_tagged(self.path)
        if current is not None and self._stale_reason(current) is None:
            raise self._refusal(current)

    def acquire(self) -> None:
        self.started = _now()
        if not self.store.create_json(self.path, self._record(self.started)):
            current, tag = self.store.read_json_tagged(self.path)
            if current is None:  # released between the two calls: one more try, which the fastest launch wins
                if not self.store.create_json(self.path, self._record(self.started)):
                    raise RunLocked(f"run {self.run!r} was claimed by another launch at the same moment")
            elif not self._takeover(current):
                raise self._refusal(current)
            elif not self.store.replace_json(self.path, self._record(self.started), tag):
                raise RunLocked(f"run {self.run!r} was taken over by another launch at the same moment")
        self._refresh_tag()
        self._thread = threading.Thread(target=self._beat, name=f"rlhf-lock-{self.run}", daemon=True)
        self._thread.start()

    def _refresh_tag(self) -> bool:
        """Reads back the lock's version after a write of ours; False when it is no longer ours."""
        current, self._tag = self.store.read_json_tagged(self.path)
        return isinstance(current, dict) and current.get("owner") == self.owner

    def _stale_reason(self, current: dict) -> str | None:
        """Why another owner's lock may be taken over, or None: its heartbeat is older than stale_after, or
        it names this host and a process that no longer exists (no need to wait then). The record comes
        from a shared store: fields of the wrong type count as a stale lock."""
        heartbeat, pid, host = current.get("heartbeat"), current.get("pid"), current.get("host")
        if not isinstance(heartbeat, (int, float)) or not isinstance(pid, int) or isinstance(pid, bool):
            return "it is malformed"
        if _now() - heartbeat >= self.stale_after:
            return f"its heartbeat is {_now() - heartbeat:.0f} s old"
        if host == socket.gethostname() and pid > 0 and not _alive(pid):
            return f"its process {pid} on this host is gone"
        return None

    def _takeover(self, current: dict) -> bool:
        """Whether another owner's lock may be taken over; every takeover is logged."""
        reason = self._stale_reason(current)
        if reason is None:
            return False
        log.warning("run %r: taking over the lock of owner %s (host %s, pid %s): %s", self.run,
                    str(current.get("owner"))[:12], str(current.get("host"))[:64], str(current.get("pid"))[:12], reason)
        return True

    def _beat(self) -> None:
        failing_since = None
        while not self._stop.wait(self.heartbeat_every):
            try:
                ours = self.store.replace_json(self.path, self._record(self.started), self._tag) and self._refresh_tag()
                failing_since, why = None, None if ours else (
                    "another launch took the run name over (it found this run's heartbeat stale)")
            except StorageError as e:
                failing_since = failing_since or _now()
                why = None
                if _now() - failing_since >= self.stale_after / 2:
                    why = f"its heartbeat could not be written for {_now() - failing_since:.0f} s ({e})"
                else:
                    log.warning("run %r: the lock's heartbeat failed (%s); retrying", self.run, e)
            if why:
                if not self._stop.is_set():
                    self.on_lost(f"run {self.run!r}: the run lock is lost: {why}; stopping the run, which "
                                 "resumes from its last checkpoint when run again")
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.store.remove_if(self.path, self.owner)

    def release_for(self, pid: int) -> None:
        """Removes the lock that process `pid` of this host took, after that process was killed before it
        could release it (`rlhf run` kills a flow process that does not stop when asked). A lock of
        another owner is left alone; one the store cannot reach is taken over later as stale."""
        try:
            current, _ = self.store.read_json_tagged(self.path)
            if current and current.get("host") == socket.gethostname() and current.get("pid") == pid:
                self.store.remove(self.path)
        except StorageError as e:
            log.warning("run %r: could not release the lock of killed process %d (%s); it is taken over once "
                        "its heartbeat is %.0f s old", self.run, pid, e, self.stale_after)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
