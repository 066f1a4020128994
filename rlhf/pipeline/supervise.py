"""`rlhf run` in two processes, so that nothing it starts outlives it.

Prefect starts a temporary API server (uvicorn) as a child of the process that runs the flow and stops
it at interpreter exit. A SIGKILL of that process skips the exit, and the server kept listening. So the
flow runs in a forked child that the kernel signals (SIGTERM, through prctl's PR_SET_PDEATHSIG) when the
process the user started dies, however it dies; the child turns SIGTERM into SystemExit, and the normal
exit path stops the server and releases the run lock. The parent only waits and passes on the status.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def fork_supervised() -> None:
    """Returns in the child, which goes on to do the work; in the parent it never returns: it waits for
    the child, forwards SIGTERM/SIGHUP to it, and exits with the child's status. On systems without
    prctl (not Linux) it returns at once and there is one process, as before."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
        signal.signal(signal.SIGTERM, _exit_on_signal)
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: os.kill(child, signal.SIGTERM))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the child too (same process group)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)
