"""Where one stage spends its time: runs the stage against a store whose inputs are complete, under py-spy,
and sums the samples by the project's own functions (inclusive: a function and what it calls).

    .venv/bin/pip install py-spy
    .venv/bin/python bench/profile_stage.py --store /path/to/store --stage grpo [--profile default] [--top 25]

The stage runs again even when the store holds it complete (its manifest is removed first); its inputs are
read as they are. py-spy samples wall-clock stacks of every thread at --rate per second (idle included:
a stage waiting on storage shows as such).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = re.compile(r"^(?P<func>[^ ]+) \((?P<file>(?:rlhf|stages)/[^:]+):\d+\)$")


def run_stage(store: str, profile: str, stage: str) -> None:
    sys.path.insert(0, str(ROOT))
    from rlhf.core.loader import load_config
    from rlhf.core.store import ArtifactStore
    from rlhf.pipeline.runner import execute_stage

    cfg = load_config(ROOT / "pipeline.yaml", profile, [f"storage.url={store}"])
    ArtifactStore(cfg.storage).clear_stage(cfg.run.name, stage)
    print(execute_stage(cfg, stage)["timings"])


def ours(frame: str) -> str | None:
    """'func (rlhf/x.py:12)' -> 'rlhf/x.py:func'; other frames -> None. py-spy prints paths relative to the
    working directory or absolute: both are cut to the project's own."""
    frame = re.sub(r"\(/.*?/(?=(?:rlhf|stages)/)", "(", frame)
    m = OURS.match(frame)
    return f"{m['file']}:{m['func']}" if m else None


def summarize(raw: Path, top: int) -> list[tuple[str, float]]:
    """Share of samples in which each project function is on the stack (each counted once per stack)."""
    counts: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        for name in {ours(f) for f in stack.split(";")} - {None}:
            counts[name] += int(n)
    return [(name, c / total) for name, c in counts.most_common(top)] if total else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--stage", required=True)
    ap.add_argument("--profile", default="default")
    ap.add_argument("--rate", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--raw", type=Path, help="keep py-spy's collapsed stacks here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        run_stage(args.store, args.profile, args.stage)
        return 0
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    raw = args.raw or Path(tempfile.mkdtemp()) / "stacks.txt"
    cmd = [spy, "record", "--format", "raw", "--rate", str(args.rate), "--subprocesses", "-o", str(raw), "--",
           sys.executable, __file__, "--child", "--store", args.store, "--stage", args.stage, "--profile", args.profile]
    rc = subprocess.call(cmd, cwd=ROOT)
    if rc != 0:
        return rc
    print(f"\n{args.stage}: share of wall-clock samples with each function on the stack ({raw})")
    for name, share in summarize(raw, args.top):
        print(f"{share:6.1%}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
