"""How long `rlhf run` takes to exit after a stop signal mid-stage: a tiny SFT run in a subprocess (as a
user starts it), signalled once its first checkpoint has landed, `--repeats` times per signal.

    .venv/bin/python bench/stop_time.py --signals TERM INT --repeats 2
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--signals", nargs="+", default=["TERM", "INT"])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    from test_lifecycle import checkpoint_landed, start_run, stop_and_time, wait_until

    for name in args.signals:
        for _ in range(args.repeats):
            store = Path(tempfile.mkdtemp(prefix="stop-time-"))
            run = start_run("stopped", store, "sft.max_steps=120", "sft.save_steps=4")
            wait_until(checkpoint_landed(store, "stopped"), run, "the first SFT checkpoint")
            seconds, _, _ = stop_and_time(run, getattr(signal, f"SIG{name}"))
            print(f"SIG{name}: exit {run.returncode} after {seconds:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
