"""benchmarks/lora.py's report from hand-made variant results: the JSON the issue names
(``lora``, ``full``, the three ratios) and the aims read from it. Nothing is trained here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks.modules import benchmark

ROOT = Path(__file__).resolve().parents[2]


def _variant(pushed: int, update_s: float, gain: float) -> dict:
    return {"pushed_bytes": pushed, "update_s_median": update_s, "gain": gain}


def test_the_lora_variant_is_rank_16_on_every_projection_at_ten_times_the_rate(tmp_path):
    lora = benchmark("lora")
    learning = lora._learning()
    extra = lora.variant_overrides("lora", 1e-5, 10.0)
    spec = learning.task_spec(lora.TASK, tmp_path / "run", steps=3, eval_size=5, extra=extra)
    assert spec.model.lora.rank == 16 and spec.model.lora.alpha == 32
    assert set(spec.model.lora.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"}
    assert spec.trainer.lr == pytest.approx(1e-4)
    assert lora.variant_overrides("full", 1e-5, 10.0) == []
    with pytest.raises(ValueError, match="variant"):
        lora.variant_overrides("qlora", 1e-5, 10.0)


def test_report_ratios_and_aims():
    lora = benchmark("lora")
    report = lora.build_report(_variant(540_000_000, 2.0, 0.30), _variant(9_000_000, 1.2, 0.27),
                               {"quick": True})
    assert report["push_bytes_ratio"] == pytest.approx(1 / 60)
    assert report["step_time_ratio"] == pytest.approx(0.6)
    assert report["gain_ratio"] == pytest.approx(0.9)
    assert report["aims"] == {"push_bytes_ratio": True, "step_time_ratio": True,
                              "gain_ratio": True} and report["aims_met"]
    slow = lora.build_report(_variant(100, 1.0, 0.0), _variant(10, 0.9, 0.1), {})
    assert slow["gain_ratio"] is None and not slow["aims"]["gain_ratio"]
    assert not slow["aims"]["push_bytes_ratio"] and not slow["aims"]["step_time_ratio"]
    json.dumps(report)


def test_variant_report_takes_medians_from_the_run_metrics():
    lora = benchmark("lora")
    rows = [{"step": 0, "eval/accuracy": 0.1},
            *({"step": i, "time/update_s": s, "time/export_weights_s": 0.1,
               "time/weight_sync_pause_s": w} for i, (s, w) in enumerate(
                   [(1.0, 0.2), (3.0, 0.4), (2.0, 0.3)], start=1))]
    v = lora.variant_report({"gain": 0.2}, rows, pushed_bytes=1234, peak_rss_mb=900.0)
    assert v["update_s_median"] == 2.0 and v["weight_sync_s_median"] == pytest.approx(0.4)
    assert v["pushed_bytes"] == 1234 and v["peak_rss_mb"] == 900.0 and v["gain"] == 0.2


def test_the_smoke_run_is_the_same_benchmark_on_the_tiny_model(tmp_path):
    lora = benchmark("lora")
    learning = lora._learning()
    for variant in ("full", "lora"):
        extra = lora.variant_overrides(variant, 1e-5, 10.0, smoke=True)
        spec = learning.task_spec(lora.TASK, tmp_path / variant, steps=2, eval_size=4,
                                  extra=extra)
        assert spec.model.path == "tiny" and spec.data.chat_template is False
        assert (spec.model.lora is not None) == (variant == "lora")
        assert spec.data.source == "reasoning_gym:chain_sum"  # the task's own rows
