"""Where environments run: a child process of their own, so that a tool that hangs, crashes, floods its
output or reaches for a file, a socket or a shell ends its episode with a recorded error, and the run goes on.

- time: each call has `timeout_s` of wall time; past it the child is killed (and started again for the
  next episode), and every episode it held ends with the error;
- memory: the child's address space is capped (RLIMIT_AS) at `memory_mb`;
- output: what the environment prints is discarded; an observation is cut to `max_chars`;
- reach: after the environment's class is loaded, a PEP 578 audit hook refuses opening files, sockets,
  subprocesses, exec, fork and ctypes in the child. This stops a tool that does these things by accident;
  it is not a boundary against code written to escape (CPython's audit hooks are not one): run a hostile
  environment in a container.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from dataclasses import dataclass

from rlhf.envs.base import Step, load_class

FORBIDDEN = ("open", "socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
             "os.forkpty", "ctypes.", "os.remove", "os.rename", "os.rmdir", "os.mkdir", "shutil.", "urllib.", "http.")


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0
    memory_mb: int = 1024
    max_chars: int = 2000


def _guard(event: str, args) -> None:
    if event.startswith(FORBIDDEN):
        raise PermissionError(f"the environment's sandbox refuses {event}")


def _serve(conn, spec: str, memory_mb: int, options: dict) -> None:
    """The child: builds environments on reset, answers steps, until the parent closes the pipe."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (printed output is discarded)
    cls = load_class(spec)
    sys.addaudithook(_guard)
    envs: dict[int, object] = {}
    while True:
        try:
            op, eid, arg = conn.recv()
        except EOFError:
            return
        try:
            if op == "reset":
                envs[eid] = cls(**options)
                envs[eid].reset(arg)
                out = ("ok", None)
            elif op == "close":
                envs.pop(eid, None)
                out = ("ok", None)
            else:
                obs, reward, done = envs[eid].step(arg)
                if obs is not None and not isinstance(obs, str):
                    raise TypeError(f"step returned an observation of type {type(obs).__name__}, not str or None")
                out = ("ok", (obs, float(reward), bool(done)))
        except BaseException as e:  # noqa: BLE001 (anything the environment raises ends its episode)
            out = ("error", f"{type(e).__name__}: {str(e)[:300]}")
        try:
            conn.send(out)
        except (MemoryError, ValueError, TypeError) as e:
            conn.send(("error", f"unsendable result ({type(e).__name__})"))


class Sandbox:
    """The parent's handle: `reset`, `step` and `close` by episode id. A failed call returns (or records) the
    error; the child is restarted on the next reset after it died or was killed."""

    def __init__(self, spec: str, limits: Limits = Limits(), options: dict | None = None):
        self.spec, self.limits, self.options = spec, limits, dict(options or {})
        self.proc = self.conn = None
        self.live: set[int] = set()  # episodes the current child holds
        self.lost: dict[int, str] = {}  # episodes whose child died: why

    def _start(self) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no torch threads or CUDA state inherited
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, self.spec, self.limits.memory_mb, self.options), daemon=True)
        self.proc.start()
        child.close()

    def _call(self, op: str, eid: int, arg) -> tuple[str, object]:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        try:
            self.conn.send((op, eid, arg))
            if self.conn.poll(self.limits.timeout_s):
                return self.conn.recv()
            why = f"no answer within {self.limits.timeout_s:g} s (killed)"
        except (EOFError, OSError, BrokenPipeError):
            why = None
        self._kill()
        if why is None:
            why = f"the environment's process died (exit code {self.proc.exitcode})"
        for other in self.live - {eid}:
            self.lost[other] = why
        self.live.clear()
        return "error", why

    def _kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join(5)

    def reset(self, eid: int, problem: dict) -> str | None:
        """None when the episode starts, else the error."""
        status, value = self._call("reset", eid, problem)
        if status == "ok":
            self.live.add(eid)
            return None
        return str(value)

    def step(self, eid: int, turn: str) -> Step:
        if eid in self.lost:
            return Step(None, 0.0, True, self.lost.pop(eid))
        status, value = self._call("step", eid, turn)
        if status != "ok":
            self.live.discard(eid)
            return Step(None, 0.0, True, str(value))
        obs, reward, done = value
        return Step(None if obs is None else obs[: self.limits.max_chars], reward, done)

    def end(self, eid: int) -> None:
        if eid in self.live:
            self.live.discard(eid)
            self._call("close", eid, None)
        self.lost.pop(eid, None)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self._kill()
