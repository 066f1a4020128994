"""`rlhf run` in two processes, so that nothing it starts outlives it and a signal stops it promptly.

Prefect starts a temporary API server (uvicorn) as a child of the process that runs the flow and stops
it at interpreter exit. A SIGKILL of that process skips the exit, and the server kept listening. So the
flow runs in a forked child that the kernel signals (SIGTERM, through prctl's PR_SET_PDEATHSIG) when the
process the user started dies, however it dies; the child turns SIGTERM into SystemExit, and the normal
exit path stops the server and releases the run lock.

The child leads a process group of its own, with everything it starts (the server, torchrun and its
ranks). So a terminal's Ctrl-C, `timeout`, or a process manager that signals the whole group reaches the
parent alone, which turns SIGINT, SIGTERM or SIGHUP into one SIGTERM for the child: the server is never
stopped under a flow that still reports to it. A stage stops where it is; that point is resumable, since
manifests are written last and checkpoints carry a completion marker. A child still alive `grace`
seconds later (stuck in a call that does not return to the interpreter), or a second signal, gets
SIGKILL with its whole group; a second before that, the child writes every thread's Python stack to its
stderr (faulthandler's watchdog, armed by the stop signal), so a stop that hangs says where. After a child that did not end cleanly, `after` releases what it held
(the run lock). When the parent itself is SIGKILLed, no one is left to kill the group, so the child's last
exit handler kills whatever of its group is still there: a server whose start the signal interrupted
(after its process started, before Prefect registered the handler that stops it) outlived the run.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import os
import signal
import sys
import time
from typing import Callable

from rlhf.core.proc import die_with_parent

GRACE = 10.0  # seconds from the first signal to SIGKILL; a clean stop measured about 1 s on 2 cores
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def stop_child(grace: float) -> Callable:
    """The child's stop handler: exit as exit_on_signal does, after arming a watchdog (a C thread, so it fires
    even while the main thread is stuck in a call that never returns to the interpreter) that writes every
    thread's stack to stderr one second before the parent's SIGKILL. A clean stop ends the process first."""
    def handler(signum, frame) -> None:
        faulthandler.dump_traceback_later(max(grace - 1.0, 0.1), file=sys.__stderr__)
        raise SystemExit(128 + signum)

    return handler


def fork_supervised(after: Callable[[int], None] | None = None, grace: float = GRACE) -> None:
    """Returns in the child, which goes on to do the work; in the parent it never returns: it waits for
    the child, passes a stop signal on, kills the child's group if it does not stop in `grace` s, calls
    after(child's pid) unless the child exited 0, and exits with the child's status (128 + the signal's
    number when a signal stopped it). On systems without prctl (not Linux) it returns at once and there is
    one process, as before."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getpid()
    # Stop signals wait (blocked) across the fork until each side has its handler: one arriving in between
    # killed the parent by the default action and left the child behind.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        die_with_parent(signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
        os.setpgid(0, 0)
        # Registered before anything the flow registers, so it runs last: the interpreter's final garbage
        # collections then skip the objects torch, transformers and Prefect made, which took 3 of the 4 s
        # of a clean stop on 2 cores (py-spy: gc_collect_main after the last atexit handler) and more than
        # 10 s on a loaded machine. Nothing needs them collected: the process is about to end.
        atexit.register(gc.freeze)
        atexit.register(kill_rest_of_group)
        for sig in STOPS:
            signal.signal(sig, stop_child(grace))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
        return
    try:  # set on both sides of the fork, as shells do: the group exists before either side relies on it
        os.setpgid(child, child)
    except (PermissionError, ProcessLookupError):  # the child set it already, or is gone
        pass
    received: list[tuple[int, float]] = []

    def on_signal(signum, frame) -> None:
        received.append((signum, time.monotonic()))
        if len(received) == 1:
            _signal(child, signal.SIGTERM)

    for sig in STOPS:
        signal.signal(sig, on_signal)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
    while True:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            _signal(-child, signal.SIGKILL)  # whatever the child left in its group (a clean exit leaves nothing)
            code = os.waitstatus_to_exitcode(status)
            code = code if code >= 0 else 128 - code
            if code != 0 and after is not None:
                after(child)
            os._exit(128 + received[0][0] if received and code != 0 else code)
        if received and (len(received) > 1 or time.monotonic() - received[0][1] > grace):
            why = "a second signal" if len(received) > 1 else f"no exit within {grace:g} s of the signal"
            print(f"rlhf run: {why}: killing the flow process {child} and every process it started", file=sys.stderr,
                  flush=True)
            _signal(-child, signal.SIGKILL)  # the child's process group
            os.waitpid(child, 0)
            if after is not None:
                after(child)
            os._exit(128 + received[0][0])
        time.sleep(0.1)


def kill_rest_of_group() -> None:
    """SIGKILL for every other process in this process's group (Linux: read from /proc). Those it started
    and stopped are gone already; what is left would outlive the run with no one to stop it."""
    me = os.getpid()
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                if os.getpgid(int(name)) == me:
                    os.kill(int(name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # gone since the listing, or not ours
                pass


def _signal(pid: int, sig: int) -> None:
    """os.kill, where a process (or group, pid < 0) that is already gone is no error."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
