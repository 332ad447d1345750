"""benchmarks/agent_turns.py: its JSON from its report function (the benchmark itself is not
run here: no timing is asserted in tests)."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.modules import benchmark


def test_the_report_compares_cached_and_flushed_turns():
    bench = benchmark("agent_turns")

    def turns(prefill, wall):
        return [{"prompt_tokens": 60 + 50 * t, "prefill_tokens": prefill(t), "cached_tokens": 0,
                 "new_tokens": 60 if t == 0 else 38, "wall_s": wall * (t + 1)} for t in range(5)]

    out = bench.report({"cached": [turns(lambda t: 60 if t == 0 else 38, 0.1)] * 3,
                        "flushed": [turns(lambda t: 60 + 50 * t, 0.2)] * 3},
                       {"model": "tiny", "tokens_per_turn": 16})
    json.dumps(out)
    assert out["turns"] == 5 and out["modes"]["cached"]["rounds"] == 3
    ratios = out["ratio_cached_over_flushed"]
    assert ratios[0]["prefill_tokens"] == 1.0
    assert ratios[4]["prefill_tokens"] == pytest.approx(38 / 260)
    assert ratios[4]["wall_s"] == pytest.approx(0.5)
    assert out["fifth_turn"] == {"new_tokens": 38, "prefill_tokens_cached": 38,
                                 "prefill_tokens_flushed": 260, "only_new_tokens_prefilled": True}
