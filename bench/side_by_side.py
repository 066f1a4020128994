"""Shared driver of the side-by-side benchmarks: every variant runs in a fresh process of its own (so its
peak RSS is its own), prints one JSON line, and the driver prints the ratios ours / TRL."""

from __future__ import annotations

import json
import subprocess
import sys


def run_variants(script: str, args: list[str], variants: tuple[str, ...] = ("ours", "trl")) -> dict[str, dict]:
    results = {}
    for name in variants:
        proc = subprocess.run([sys.executable, script, "--variant", name, *args], capture_output=True, text=True, check=True)
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(json.dumps(results[name]))
    return results


def cache_ratios(ours: dict, trl: dict) -> dict:
    """Epoch-time and peak-RSS ratios of a cached-reference trainer against TRL's per-step reference."""
    return {
        "epoch_time_ratio_ours_over_trl": round(ours["epoch_s"] / trl["epoch_s"], 3),
        "peak_rss_ratio_ours_over_trl": round(ours["peak_rss_mb"] / trl["peak_rss_mb"], 3),
        "cache_build_s": round(ours["cache_build_s"], 2),
        "cache_build_plus_epoch_over_trl_epoch": round((ours["cache_build_s"] + ours["epoch_s"]) / trl["epoch_s"], 3),
    }
