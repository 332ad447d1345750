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


def test_a_side_skips_its_first_steps_for_the_median_and_rate():
    vs_trl = _vs_trl()
    step_s = [5.0, 4.0, 3.0, 1.0, 2.0, 1.0, 1.0]  # the first SKIP steps carry start-up costs
    out = vs_trl._summary(step_s, [10.0] * 7, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7])
    assert vs_trl.SKIP == 3
    assert out["steps"] == 7 and out["step_s_median"] == 1.0
    assert out["tokens_per_s"] == pytest.approx(40.0 / 5.0)
    assert out["reward_first"] == pytest.approx(0.1) and out["reward_last"] == pytest.approx(0.7)
    assert out["reward_curve"] == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]


def test_an_oolong_side_counts_the_batchs_response_tokens_as_trl_does():
    vs_trl = _vs_trl()
    w = vs_trl.WORKLOADS["demo"]
    rows = [{"step": i, "time/step_s": 0.5, "response_length/mean": 6.0, "reward/mean": 0.5}
            for i in range(1, 6)]
    out = vs_trl.oolong_result(rows, "demo", 2, 1, "float32")
    batch = w["group_size"] * w["batch_groups"]
    assert out["tokens_per_s"] == pytest.approx(6.0 * batch / 0.5)
    assert out["max_staleness"] == 2 and out["precision"] == "float32"
    assert out["steps"] == 5 and "1 rollout servers" in out["threads"]
