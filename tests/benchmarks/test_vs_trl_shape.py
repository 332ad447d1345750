"""benchmarks/vs_trl.py on a 2-step run: the JSON has every key the README and the issue name.
No timing is asserted (the machine is shared): only that each system ran and reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_vs_trl_writes_the_ratios_for_both_workloads(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "vs_trl.json"
    subprocess.run([sys.executable, "benchmarks/vs_trl.py", "--steps", "2", "--warm-start-s", "2",
                    "--repeats", "1", "--workloads", "demo,long_tail",
                    "--out", str(out), "--work-dir", str(tmp_path / "work")],
                   cwd=ROOT, check=True, timeout=900)
    report = json.loads(out.read_text())
    assert set(report["workloads"]) == {"demo", "long_tail"}
    for workload in report["workloads"].values():
        for system in ("trl", "oolong_sync", "oolong_async"):
            result = workload[system]
            assert result["steps"] == 2
            assert result["step_s_median"] > 0 and result["tokens_per_s"] > 0
            assert len(result["reward_curve"]) == 2
            assert all(0.0 <= r <= 1.0 for r in result["reward_curve"])
            assert "threads" in result
        assert workload["oolong_sync"]["max_staleness"] == 0
        assert workload["oolong_async"]["max_staleness"] == 2
        for ratio in ("async_vs_trl", "sync_vs_trl", "async_vs_sync"):
            assert workload[ratio] > 0
        assert workload["async_vs_trl"] == pytest.approx(
            workload["trl"]["step_s_median"] / workload["oolong_async"]["step_s_median"])
        assert workload["median_round"] == 0 and len(workload["rounds"]) == 1
        assert workload["ranges"]["async_vs_trl"] == pytest.approx([workload["async_vs_trl"]] * 2)
    assert report["config"]["steps"] == {"demo": 2, "long_tail": 2}
    assert report["config"]["repeats"] == 1
    assert report["machine"]["cpus"] >= 1
