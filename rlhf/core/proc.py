"""Child processes that cannot outlive the process that started them (Linux: prctl's PR_SET_PDEATHSIG)."""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Asks the kernel to send `sig` to this process when its parent thread exits, however it exits (a
    SIGKILL too). Call it in the child: first thing after fork, or as subprocess's preexec_fn. Elsewhere
    than Linux it does nothing."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)

