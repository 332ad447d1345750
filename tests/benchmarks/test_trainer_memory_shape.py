"""benchmarks/trainer_memory.py: one configuration measured in this process on the tiny model
(the high-water mark is reset and read back), and the report's ratios against the baseline."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.modules import benchmark


def test_one_configuration_is_measured_from_a_reset_high_water_mark():
    bench = benchmark("trainer_memory")
    r = bench.measure("chunked_checkpointing", 32, model="tiny")
    assert r["tokens"] == 8 * (32 - 16), "8 rows, half of each generated"
    assert r["activation_checkpointing"] is True and r["logit_chunk_tokens"] == 1024
    assert r["peak_rss_bytes"] >= r["rss_before_bytes"] > 0
    assert r["peak_step_bytes"] == r["peak_rss_bytes"] - r["rss_before_bytes"]
    assert r["grad_norm"] > 0


def test_the_report_divides_each_peak_by_the_plain_path():
    bench = benchmark("trainer_memory")
    configs = {name: {"peak_step_bytes": peak} for name, peak in
               (("plain", 800), ("chunked", 600), ("chunked_checkpointing", 200))}
    out = bench.report(configs, model="tiny", tokens=256)
    json.dumps(out)
    assert out["ratios"] == pytest.approx({"plain": 1.0, "chunked": 0.75,
                                           "chunked_checkpointing": 0.25})
    assert out["model"] == "tiny" and out["configs"] is configs
