"""vs_trl.py's real-model workloads: what each side is given, and the report they make. Nothing
is run here (a SmolLM2 round takes minutes): the specs and the report function are checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.modules import benchmark

ROOT = Path(__file__).resolve().parents[2]


def _vs_trl():
    return benchmark("vs_trl")


def test_smollm2_means_both_precisions_on_the_same_task():
    vs_trl = _vs_trl()
    assert vs_trl.ALIASES["smollm2"] == ["smollm2_fp32", "smollm2_bf16"]
    fp32, bf16 = (vs_trl.WORKLOADS[w] for w in vs_trl.ALIASES["smollm2"])
    assert (fp32["dtype"], bf16["dtype"]) == ("float32", "bfloat16")
    # only the precision differs between the two workloads
    assert {k: v for k, v in fp32.items() if k != "dtype"} == {
        k: v for k, v in bf16.items() if k != "dtype"}


@pytest.mark.parametrize("workload,dtype", [("smollm2_fp32", "float32"),
                                            ("smollm2_bf16", "bfloat16")])
def test_the_oolong_sides_get_the_real_model_task_at_the_workloads_precision(workload, dtype):
    vs_trl = _vs_trl()
    spec = vs_trl._spec(workload, 1, ["rollout.max_staleness=0"])
    w = vs_trl.WORKLOADS[workload]
    assert spec.model.path == "smollm2" and spec.model.dtype == dtype
    assert spec.data.source == "reasoning_gym:chain_sum" and spec.data.chat_template
    assert spec.data.options == {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    assert spec.reward.fn == "builtin:numeric" and spec.rollout.max_staleness == 0
    assert (w["group_size"], w["batch_groups"], w["max_new_tokens"]) == (4, 4, 32)


def test_tiny_workloads_keep_their_task():
    vs_trl = _vs_trl()
    spec = vs_trl._spec("demo", 1)
    assert spec.model.path == "tiny" and spec.model.dtype == "float32"
    assert spec.data.source == "synthetic:arithmetic" and not spec.data.chat_template
    assert spec.reward.fn == "builtin:arithmetic"


def test_steps_per_workload():
    vs_trl = _vs_trl()
    assert vs_trl.workload_steps("demo", None, True) == 12
    assert vs_trl.workload_steps("demo", None, False) == 40
    w = vs_trl.WORKLOADS["smollm2_bf16"]
    assert vs_trl.workload_steps("smollm2_bf16", None, True) == w["quick_steps"]
    assert vs_trl.workload_steps("smollm2_bf16", None, False) == w["steps"]
    assert vs_trl.workload_steps("smollm2_bf16", 3, True) == 3


def _side(step_s: float, dtype: str, reward_last: float) -> dict:
    return {"steps": 8, "step_s_median": step_s, "tokens_per_s": 100.0 / step_s,
            "reward_first": 0.2, "reward_last": reward_last, "precision": dtype}


def test_a_smollm2_report_keeps_each_precision_apart():
    vs_trl = _vs_trl()
    report = {w: vs_trl.combine_rounds([{"trl": _side(8.0 * k, p, 0.3),
                                         "oolong_sync": _side(4.0 * k, p, 0.3),
                                         "oolong_async": _side(2.0 * k, p, 0.35)}])
              for w, p, k in (("smollm2_fp32", "float32", 2.0), ("smollm2_bf16", "bfloat16", 1.0))}
    for w, p in (("smollm2_fp32", "float32"), ("smollm2_bf16", "bfloat16")):
        r = report[w]
        assert {r[s]["precision"] for s in vs_trl.SYSTEMS} == {p}
        assert r["async_vs_trl"] == pytest.approx(4.0) and r["sync_vs_trl"] == pytest.approx(2.0)
        assert r["oolong_async"]["reward_last"] == 0.35
