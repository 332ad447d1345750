"""How benchmarks/async_vs_sync.py turns metric rows and pairs of runs into the JSON the README
quotes: called on rows shaped like a run's metrics.jsonl, never by running the benchmark (the
training it would run is covered by the engine's own tests)."""

from __future__ import annotations

import pytest

from tests.benchmarks.modules import benchmark
from training_core import metric_names


def _bench():
    return benchmark("async_vs_sync")


def _rows(step_s: list[float], staleness: int, reward0: float = 0.1) -> list[dict]:
    return [{"step": i + 1, "time/step_s": s, "tokens/consumed": 100.0 * (i + 1),
             "reward/mean": reward0 + 0.1 * i, "staleness/mean": staleness / 2,
             "staleness/max": staleness, "time/generation_wait_s": s / 2,
             "time/weight_sync_pause_s": 0.01, "response_length/mean": 10.0 + i,
             "response_length/max": 20 + i} for i, s in enumerate(step_s)]


def test_the_rows_it_reads_are_metrics_the_trainer_produces():
    keys = set(_rows([1.0], 0)[0]) - {"step"}
    assert keys <= metric_names.DECLARED, keys - metric_names.DECLARED


def test_a_side_is_summed_over_its_steps_and_its_rewards_averaged_at_each_end():
    rows = _rows([1.0, 2.0, 3.0, 2.0, 2.0, 2.0, 2.0, 2.0], staleness=2)
    side = _bench().side_result(rows, 2, total_run_s=40.0)
    assert side["steps"] == 8 and side["wall_s"] == pytest.approx(16.0)
    assert side["consumed_tokens"] == pytest.approx(3600.0)
    assert side["effective_tokens_per_s"] == pytest.approx(3600.0 / 16.0)
    # A quarter of the steps, at least three, at each end.
    assert side["first_reward"] == pytest.approx((0.1 + 0.2 + 0.3) / 3)
    assert side["final_reward"] == pytest.approx((0.6 + 0.7 + 0.8) / 3)
    assert side["max_staleness_seen"] == 2 and side["response_length_max"] == 27
    assert side["total_run_s"] == 40.0


def _pair(first: str, sync_wall: float, async_wall: float) -> dict:
    bench = _bench()
    sync = bench.side_result(_rows([sync_wall / 4] * 4, 0), 0, 1.0)
    asynchronous = bench.side_result(_rows([async_wall / 4] * 4, 2, reward0=0.2), 2, 1.0)
    return {"first": first, "sync": sync, "async": asynchronous,
            "speedup": sync["wall_s"] / asynchronous["wall_s"]}


def test_the_report_puts_the_median_pair_on_top_with_every_pair_below():
    pairs = [_pair("sync", 12.0, 6.0), _pair("async", 12.0, 4.0), _pair("sync", 12.0, 8.0)]
    out = _bench().report(pairs, {"steps": 4, "staleness": 2})
    assert [p["first"] for p in out["pairs"]] == ["sync", "async", "sync"]
    assert out["speedup"] == pytest.approx(2.0)  # the median of 2.0, 3.0 and 1.5
    assert out["speedup_range"] == pytest.approx([1.5, 3.0])
    # The figures on top are the median pair's own: its ratio is the reported speedup.
    assert out["sync"]["wall_s"] / out["async"]["wall_s"] == pytest.approx(out["speedup"])
    assert out["async"]["wall_s"] == pytest.approx(6.0)
    assert out["reward_delta"] == pytest.approx(0.1)
    assert out["config"] == {"steps": 4, "staleness": 2, "repeats": 3}
    assert out["machine"]["cpus"] >= 1


def test_an_even_number_of_pairs_reports_the_lower_middle_one():
    pairs = [_pair("sync", 12.0, 4.0), _pair("async", 12.0, 8.0)]
    out = _bench().report(pairs, {})
    assert out["speedup"] == pytest.approx(1.5)
    assert out["pairs"][1]["async_wall_s"] == pytest.approx(out["async"]["wall_s"])
