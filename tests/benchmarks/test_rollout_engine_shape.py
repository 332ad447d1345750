"""benchmarks/rollout_engine.py's JSON, from its report function (the benchmark itself is not
run: no timing is asserted in tests). The keys are the issue's: one object per precision with
``batches`` "16" and "64", each with embedded_tok_s, hf_tok_s, ratio and bound_tok_s."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from tests.benchmarks.modules import benchmark

ROOT = Path(__file__).resolve().parents[2]


def _module():
    return benchmark("rollout_engine")


def _measured(embedded: list[float], hf: list[float], bound: float) -> dict:
    return {"embedded": embedded, "hf": hf, "bound_tok_s": bound,
            "compute_bound_tok_s": bound, "memory_bound_tok_s": 3 * bound,
            "matmul_gflops": 100.0}


def test_the_report_has_the_issues_keys_per_precision_and_batch():
    bench = _module()
    measured = {
        "float32": {16: _measured([200, 240, 220], [100, 130, 90], 900),
                    64: _measured([400, 410], [300, 250], 3000)},
        "bfloat16": {16: _measured([700], [300], 2500), 64: _measured([2100, 1900, 2200], [900, 800, 1000], 9000)},
    }
    out = bench.report(measured, {"new_tokens": 32}, {"threads": 2})
    json.dumps(out)  # plain JSON
    assert [r["precision"] for r in out["runs"]] == ["float32", "bfloat16"]
    for run in out["runs"]:
        assert set(run["batches"]) == {"16", "64"}
        for batch, b in run["batches"].items():
            m = measured[run["precision"]][int(batch)]
            assert b["embedded_tok_s"] == statistics.median(m["embedded"])
            assert b["hf_tok_s"] == statistics.median(m["hf"])
            assert b["ratio"] == pytest.approx(b["embedded_tok_s"] / b["hf_tok_s"])
            assert b["bound_tok_s"] == m["bound_tok_s"]
    assert out["aims"]["bf16_batch64_ge_2000_tok_s"] is True  # median 2100
    assert out["aims"]["ratio_ge_2"] == {"float32": False, "bfloat16": True}


def test_the_report_says_what_the_servers_projections_were_from_their_log(tmp_path):
    """The server logs the projections its decode step chose (fused_decode: measured per batch
    size); the report carries that line per precision, None where no log said it."""
    bench = _module()
    (tmp_path / "rollout-server-0.log").write_text(
        "2026-11-26 06:34:02,461 server INFO avx512-pairs projections measured against oneDNN's\n"
        "2026-11-26 06:34:02,462 server INFO decode projections: avx512-pairs at 1-3, 64+ rows\n")
    assert bench.server_projections(tmp_path) == "avx512-pairs at 1-3, 64+ rows"
    assert bench.server_projections(tmp_path / "missing") is None
    measured = {"bfloat16": {64: _measured([700], [300], 2500)},
                "float32": {64: _measured([400], [200], 900)}}
    out = bench.report(measured, {}, {}, {"bfloat16": "avx512-pairs at 1-3, 64+ rows"})
    assert [r["projections"] for r in out["runs"]] == ["avx512-pairs at 1-3, 64+ rows", None]


def test_the_reference_results_have_that_shape():
    for path in sorted((ROOT / "benchmarks" / "results").glob("rollout_engine*.json")):
        out = json.loads(path.read_text())
        for run in out["runs"]:
            assert run["precision"] in ("float32", "bfloat16")
            for b in run["batches"].values():
                assert {"embedded_tok_s", "hf_tok_s", "ratio", "bound_tok_s"} <= set(b)


def test_the_memory_bound_counts_each_rows_kv_cache():
    """A decode step reads each row's keys and values of every layer besides the weights: at 64
    rows and ~100 positions that is about half the weights' bytes for SmolLM2, so a bound of
    weights alone overstates what the memory allows."""
    from types import SimpleNamespace

    import torch

    bench = _module()
    smollm2 = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                              num_hidden_layers=30)
    # keys and values, 30 layers, 3 heads of 64 dims, 2 bytes each, at 100 positions
    assert bench.kv_bytes_per_row(smollm2, torch.bfloat16, 100) == 2 * 30 * 3 * 64 * 2 * 100
    assert bench.kv_bytes_per_row(smollm2, torch.float32, 50.5) == 2 * 30 * 3 * 64 * 4 * 50.5
    out = bench.report({"bfloat16": {64: {**_measured([700], [300], 2500),
                                          "step_mb": {"weights": 269.1, "kv_cache": 150.0}}}},
                       {"new_tokens": 32}, {"threads": 2})
    assert out["runs"][0]["batches"]["64"]["step_mb"] == {"weights": 269.1, "kv_cache": 150.0}
