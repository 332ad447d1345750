"""benchmarks/engine_step.py: its JSON from its report function, and its timing hooks on the
tiny model (the benchmark itself is not run: no timing is asserted in tests)."""

from __future__ import annotations

import json
import math

import pytest

from tests.benchmarks.modules import benchmark


def test_the_report_takes_medians_and_says_where_a_step_goes():
    bench = benchmark("engine_step")
    rounds = [{"wall_s": w, "steps": 127, "step_s": [s] * 127, "prefill_s": p}
              for w, s, p in ((8.0, 0.050, 1.0), (10.0, 0.060, 1.5), (9.0, 0.055, 1.2))]
    out = bench.report({"bfloat16": {"rounds": rounds, "projections_ms": 44.0,
                                     "projections": "avx512-pairs at 1+ rows"},
                        "float32": {"rounds": rounds[:1], "projections_ms": None,
                                    "projections": "oneDNN's"}},
                       {"batch": 64, "new_tokens": 128}, {"threads": 2})
    json.dumps(out)  # plain JSON
    bf16, fp32 = out["runs"]
    assert bf16["precision"] == "bfloat16" and bf16["batch"] == 64
    assert bf16["tok_s"] == pytest.approx(64 * 128 / 9.0)
    assert bf16["step_ms"] == pytest.approx(55.0) and bf16["prefill_s"] == 1.2
    assert bf16["projections_share"] == pytest.approx(44.0 / 55.0)
    assert bf16["steps_share"] == pytest.approx(127 * 0.055 / 9.0)
    assert [r["step_ms"] for r in bf16["rounds"]] == pytest.approx([50.0, 60.0, 55.0])
    assert fp32["projections_share"] is None and fp32["tok_s"] == pytest.approx(64 * 128 / 8.0)


@pytest.fixture(scope="module")
def tiny_model_dir():
    from training_core.models.paths import resolve_model_dir

    return resolve_model_dir("tiny")


def test_the_hooks_time_every_step_and_prefill_of_a_request_and_leave_the_decoder_as_it_was(
        tiny_model_dir):
    from training_core.rollout_server.fused_decode import FusedDecoder
    from training_core.rollout_server.generation_engine import GenerationEngine

    bench = benchmark("engine_step")
    engine = GenerationEngine(str(tiny_model_dir), seed=1)
    try:
        assert engine._fused is not None, "the tiny model decodes fused"
        before = (FusedDecoder.__call__, FusedDecoder.prefill)
        times: dict[str, list[float]] = {"step": [], "prefill": []}
        with bench.timed_decoder(times):
            wall = bench.answer(engine, [[5, 6, 7, 8], [9, 10, 11]], 6)
        assert (FusedDecoder.__call__, FusedDecoder.prefill) == before
        # the first token comes from the prefill, each further one from a decode step
        assert len(times["step"]) == 5 and len(times["prefill"]) == 1
        assert 0 < sum(times["step"]) + times["prefill"][0] < wall
        bench.answer(engine, [[5, 6, 7]], 3)  # no longer timed
        assert len(times["step"]) == 5
        assert math.isfinite(bench.projections_ms(engine._fused, 2, 2))
    finally:
        engine.shutdown()
