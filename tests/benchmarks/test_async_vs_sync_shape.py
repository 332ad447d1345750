"""benchmarks/async_vs_sync.py on two 2-step pairs: the JSON the README quotes, with every pair's
figures, the sides alternating which goes first, and the median pair's results on top. No timing
is asserted (the machine is shared): only that each side ran and reported."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_async_vs_sync_reports_the_median_of_alternating_pairs(tmp_path):
    out = tmp_path / "async_vs_sync.json"
    subprocess.run([sys.executable, "benchmarks/async_vs_sync.py", "--steps", "2", "--repeats", "2",
                    "--warm-start-s", "2", "--out", str(out), "--work-dir", str(tmp_path / "work")],
                   cwd=ROOT, check=True, timeout=900)
    report = json.loads(out.read_text())
    pairs = report["pairs"]
    assert [p["first"] for p in pairs] == ["sync", "async"]
    for p in pairs:
        assert p["speedup"] == pytest.approx(p["sync_wall_s"] / p["async_wall_s"])
    speedups = [p["speedup"] for p in pairs]
    assert report["speedup"] == statistics.median_low(speedups)
    assert report["speedup_range"] == [min(speedups), max(speedups)]
    # On top: the median pair (the lower one of two), whose ratio is the reported speedup.
    low = min(pairs, key=lambda p: p["speedup"])
    assert report["sync"]["wall_s"] == low["sync_wall_s"] and report["async"]["wall_s"] == low["async_wall_s"]
    assert report["speedup"] == pytest.approx(report["sync"]["wall_s"] / report["async"]["wall_s"])
    assert report["sync"]["max_staleness"] == 0 and report["async"]["max_staleness"] == 2
    for side in ("sync", "async"):
        assert report[side]["steps"] == 2 and report[side]["consumed_tokens"] > 0
    assert report["config"]["repeats"] == 2 and report["config"]["steps"] == 2
    # Each pair ran in its own directory: nothing of one pair's run was reused by the next.
    assert {d.name for d in (tmp_path / "work").glob("pair-*")} == {"pair-0", "pair-1"}
