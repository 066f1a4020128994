"""Per-stage peak RSS: a sampled maximum over this process and its children, not the lifetime peak."""

from __future__ import annotations

import subprocess
import sys
import time

from rlhf.core.resources import PeakRSS


def test_peak_counts_this_process_and_children_and_forgets_earlier_peaks():
    with PeakRSS(interval=0.05) as here:
        block = bytearray(300 * 2**20)  # touched pages: resident
        time.sleep(0.3)
        del block
    assert here.peak - here.start > 250 * 2**20
    with PeakRSS(interval=0.05) as later:  # a second stage does not inherit the first one's peak
        time.sleep(0.2)
    assert later.peak - later.start < 100 * 2**20
    with PeakRSS(interval=0.05) as child:  # a launched stage's ranks are children
        subprocess.run([sys.executable, "-c", "import time; b = bytearray(300 * 2**20); time.sleep(1.0)"], check=True)
    assert child.peak - child.start > 250 * 2**20
    assert set(child.figures()) == {"peak_rss_mb", "start_rss_mb"}
