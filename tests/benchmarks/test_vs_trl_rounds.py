"""How vs_trl.py turns its rounds into one report: every reported ratio comes from one round."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.modules import benchmark

ROOT = Path(__file__).resolve().parents[2]


def _vs_trl():
    return benchmark("vs_trl")


def _round(trl: float, sync: float, asynchronous: float, tag: str) -> dict:
    return {"trl": {"step_s_median": trl, "tag": tag},
            "oolong_sync": {"step_s_median": sync, "tag": tag},
            "oolong_async": {"step_s_median": asynchronous, "tag": tag}}


def test_the_round_with_the_median_async_ratio_stands_for_the_workload():
    vs_trl = _vs_trl()
    rounds = [_round(0.30, 0.20, 0.10, "a"),   # async/TRL 3.0
              _round(0.20, 0.25, 0.125, "b"),  # 1.6
              _round(0.24, 0.16, 0.12, "c")]   # 2.0: the median
    report = vs_trl.combine_rounds(rounds)
    assert report["median_round"] == 2
    assert {report[s]["tag"] for s in ("trl", "oolong_sync", "oolong_async")} == {"c"}
    assert report["async_vs_trl"] == pytest.approx(2.0)
    assert report["sync_vs_trl"] == pytest.approx(1.5)
    assert report["async_vs_sync"] == pytest.approx(0.16 / 0.12)
    assert report["ranges"]["async_vs_trl"] == pytest.approx([1.6, 3.0])
    assert report["ranges"]["sync_vs_trl"] == pytest.approx([0.8, 1.5])
    assert [r["async_vs_trl"] for r in report["rounds"]] == pytest.approx([3.0, 1.6, 2.0])
    assert report["rounds"][1]["oolong_sync"] == 0.25


def test_an_even_number_of_rounds_takes_the_lower_middle_one():
    vs_trl = _vs_trl()
    report = vs_trl.combine_rounds([_round(0.3, 0.2, 0.1, "a"), _round(0.2, 0.2, 0.1, "b")])
    assert report["median_round"] == 1 and report["async_vs_trl"] == pytest.approx(2.0)
