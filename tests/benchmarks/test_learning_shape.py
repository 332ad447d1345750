"""benchmarks/learning.py's report, from hand-made run results: the JSON the docs and the issue
name, with every figure derived from the run's own metrics. Nothing is trained here (the
real-model run is tests/training_core/models/test_learning_smollm2.py, slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks.modules import benchmark

ROOT = Path(__file__).resolve().parents[2]


def _learning():
    return benchmark("learning")


def _rows(step_s: list[float], rewards: list[float], length: float = 10.0) -> list[dict]:
    rows = [{"step": 0, "eval/accuracy": 0.25, "version": 0}]  # train.py's step-0 eval line
    rows += [{"step": i + 1, "time/step_s": s, "reward/mean": r, "response_length/mean": length}
             for i, (s, r) in enumerate(zip(step_s, rewards, strict=True))]
    return rows


@pytest.mark.parametrize("config", ["learning-chain-sum.yaml", "learning-products.yaml"])
def test_each_task_is_a_smollm2_reasoning_gym_spec_shortened_by_the_benchmark(config, tmp_path):
    learning = _learning()
    spec = learning.task_spec(ROOT / "configs" / config, tmp_path / "run", steps=5, eval_size=7)
    assert spec.model.path == "smollm2" and spec.data.chat_template
    assert spec.data.source.startswith("reasoning_gym:")
    # evaluated only before the first step and after the last (train.py: step 0 and the end)
    assert spec.trainer.steps == 5 and spec.eval.every == 5 and spec.eval.size == 7
    assert spec.data.eval_size >= 7 and spec.checkpoint.every == 0
    assert spec.run_dir == str(tmp_path / "run")


def test_task_report_derives_every_figure_from_the_run(tmp_path):
    learning = _learning()
    spec = learning.task_spec(ROOT / "configs" / "learning-chain-sum.yaml", tmp_path, steps=8,
                              eval_size=10)
    step_s = [30.0, 20.0, 20.0, 10.0, 10.0, 10.0, 10.0, 10.0]  # 120 s
    rewards = [0.1, 0.3, 0.2, 0.4, 0.5, 0.6, 0.5, 0.7]
    t = learning.task_report(spec, {"eval/accuracy": 0.2, "eval/reward": 0.2},
                             {"eval/accuracy": 0.5, "eval/reward": 0.5},
                             _rows(step_s, rewards), wall_s=300.0, eval_seen_in_train=0.1)
    batch = spec.rollout.group_size * spec.trainer.batch_groups
    assert t["before"] == 0.2 and t["after"] == 0.5 and t["gain"] == pytest.approx(0.3)
    assert t["steps"] == 8 and t["minutes"] == pytest.approx(2.0)
    assert t["wall_minutes"] == pytest.approx(5.0)
    assert t["tokens_per_s"] == pytest.approx(8 * 10.0 * batch / 120.0)
    assert t["reward_first"] == pytest.approx(0.2) and t["reward_last"] == pytest.approx(0.6)
    assert t["reward_curve"] == rewards and t["step_s_median"] == 10.0
    assert t["start_in_range"] and t["aim_met"]  # +30 points in 2 minutes
    assert t["eval_items"] == 10 and t["eval_seen_in_train"] == 0.1
    assert t["task"]["source"] == "reasoning_gym:chain_sum" and t["task"]["reward"]
    json.dumps(t)  # JSON-serialisable as written

    small = learning.task_report(spec, {"eval/accuracy": 0.2, "eval/reward": 0.2},
                                 {"eval/accuracy": 0.3, "eval/reward": 0.3},
                                 _rows(step_s, rewards), wall_s=300.0, eval_seen_in_train=0.0)
    assert not small["aim_met"]  # +10 points is short of the aim
    slow = learning.task_report(spec, {"eval/accuracy": 0.05, "eval/reward": 0.05},
                                {"eval/accuracy": 0.9, "eval/reward": 0.9},
                                _rows([100.0] * 8, rewards), wall_s=900.0, eval_seen_in_train=0.0)
    assert not slow["aim_met"] and not slow["start_in_range"]  # 13 minutes; started below 10%


def test_a_run_without_evaluations_is_refused_not_reported(tmp_path):
    learning = _learning()
    spec = learning.task_spec(ROOT / "configs" / "learning-chain-sum.yaml", tmp_path, steps=2)
    with pytest.raises(ValueError, match="evaluation"):
        learning.task_report(spec, None, None, _rows([1.0, 1.0], [0.1, 0.2]), 10.0, 0.0)


def test_build_report_has_the_issue_shape():
    learning = _learning()
    task = {"before": 0.2, "after": 0.45, "minutes": 9.0, "steps": 40, "aim_met": True}
    report = learning.build_report({"chain_sum": task, "products": {**task, "aim_met": False}},
                                   {"quick": True})
    assert set(report["tasks"]) == {"chain_sum", "products"}
    for t in report["tasks"].values():
        assert {"before", "after", "minutes", "steps"} <= set(t)
    assert report["all_aims_met"] is False
    assert report["config"] == {"quick": True} and report["machine"]["cpus"] >= 1


def test_the_scan_reference_names_the_chosen_tasks_inside_the_range():
    scan = json.loads((ROOT / "benchmarks" / "results" / "learning_scan.json").read_text())
    low, high = scan["range"]
    chosen = {row["chosen"]: row for row in scan["scan"] if "chosen" in row}
    learning = _learning()
    assert {str(p.relative_to(ROOT)) for p in learning.TASKS.values()} == set(chosen)
    for row in scan["scan"]:
        assert row["in_range"] == (low <= row["greedy_accuracy"] <= high)
    assert all(row["in_range"] for row in chosen.values())
