"""benchmarks/time_to_accuracy.py: the held-out split, and the report (target, minutes to it,
intervals, the issue's aims) from hand-made curves; and ``--smoke`` end to end with the tiny
model (three systems trained, every saved point scored by the one evaluator)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.modules import benchmark

ROOT = Path(__file__).resolve().parents[2]


def _tta():
    return benchmark("time_to_accuracy")


def test_the_task_has_800_distinct_questions_and_holds_160_out_by_question():
    tta = _tta()
    rows = tta.questions()
    assert len(rows) == 800 == len({r["question"] for r in rows})
    assert {"question": tta.QUESTION.format(a=7, op="-", b=19), "answer": "-12"} in rows
    pool, held = tta.split(rows)
    assert (len(pool), len(held)) == (640, 160)
    assert not {r["question"] for r in pool} & {r["question"] for r in held}
    assert tta.split(rows) == (pool, held)  # seeded: every system and seed gets the same split
    assert tta.split(rows, seed=tta.SPLIT_SEED + 1)[1] != held


def test_a_question_set_with_duplicates_is_refused():
    tta = _tta()
    rows = tta.questions()
    with pytest.raises(ValueError, match="duplicates"):
        tta.split([*rows, rows[0]])


def test_save_points_spread_to_the_last_step():
    tta = _tta()
    assert tta.save_points(24, 4) == [6, 12, 18, 24]
    assert tta.save_points(8, 2) == [4, 8]
    assert tta.save_points(2, 5) == [1, 2]  # fewer steps than points: each step once
    with pytest.raises(ValueError, match="--steps and --points"):
        tta.save_points(8, 0)


def test_first_crossing_interpolates_between_the_points_around_it():
    tta = _tta()
    curve = [(0.0, 0.2), (2.0, 0.6), (4.0, 0.4), (6.0, 0.8)]
    assert tta.first_crossing(curve, 0.3) == pytest.approx(0.5)
    assert tta.first_crossing(curve, 0.6) == pytest.approx(2.0)
    assert tta.first_crossing(curve, 0.7) == pytest.approx(5.5)  # after the dip, not before
    assert tta.first_crossing(curve, 0.1) == 0.0
    assert tta.first_crossing(curve, 0.9) is None


def _seed(points: list[tuple[int, float, list[int]]], train_s: float) -> dict:
    return {"points": [{"step": st, "seconds": s, "scores": sc} for st, s, sc in points],
            "train_s": train_s, "step_metrics": {}}


START = [0, 0, 0, 1]  # four held-out questions; the starting model gets one right


def _systems(tta, async_last: list[int] = (1, 1, 1, 1)):
    return {
        "oolong_async": tta.system_report(START, [
            _seed([(4, 60, [1, 0, 0, 1]), (8, 120, [1, 1, 0, 1])], 130),
            _seed([(4, 60, [1, 0, 0, 1]), (8, 120, list(async_last))], 130)]),
        "oolong_sync": tta.system_report(START, [
            _seed([(4, 120, [1, 0, 0, 1]), (8, 240, [1, 1, 0, 1])], 250)]),
        "trl": tta.system_report(START, [
            _seed([(4, 300, [0, 0, 0, 1]), (8, 600, [1, 0, 0, 1])], 610)]),
    }


def test_the_report_reads_target_minutes_intervals_and_aims_off_the_curves():
    tta = _tta()
    report = tta.build_report(_systems(tta), {"machine": {"cpus": 2}})
    a, s, t = (report["systems"][n] for n in ("oolong_async", "oolong_sync", "trl"))
    # finals: seed means of the last point; the target is the lowest of them (TRL's)
    assert (a["final"], s["final"], t["final"]) == (0.875, 0.75, 0.5)
    assert report["target"] == 0.5 and report["target_from"] == "trl"
    assert a["final_per_seed"] == [0.75, 1.0] and a["seeds"] == 2 and t["seeds"] == 1
    # the interval is over questions, each averaged over the seeds: [1, 1, .5, 1]
    se = 0.25 / math.sqrt(4)
    assert a["ci95"] == pytest.approx([0.875 - 1.96 * se, 1.0])  # clipped at 1
    assert s["ci95"] == pytest.approx([0.75 - 1.96 * 0.25, 1.0])
    # curves start at the shared starting model, minutes averaged over seeds
    assert [(p["step"], p["minutes"], p["accuracy"]) for p in a["curve"]] == [
        (0, 0.0, 0.25), (4, 1.0, 0.5), (8, 2.0, 0.875)]
    # minutes to 0.5 on the seed-mean curve: async at its step 4 (1 min), sync at 2, TRL at 10
    assert a["minutes_to_target"] == pytest.approx(1.0)
    assert s["minutes_to_target"] == pytest.approx(2.0)
    assert t["minutes_to_target"] == pytest.approx(10.0)
    assert a["minutes_to_target_per_seed"] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert a["train_minutes"] == pytest.approx(130 / 60)
    aims = report["aims"]
    assert aims["async_reaches_trl_final_in_half_trl_time"]["met"]
    assert aims["async_reaches_trl_final_in_half_trl_time"]["ratio"] == pytest.approx(0.1)
    assert aims["async_final_within_sync_ci"]["met"]
    assert aims["async_target_at_most_0_8_sync"]["met"]
    assert aims["async_target_at_most_0_8_sync"]["ratio"] == pytest.approx(0.5)
    assert report["machine"] == {"cpus": 2}
    json.dumps(report)


def test_aims_fail_when_async_loses_accuracy_or_time():
    tta = _tta()
    systems = _systems(tta, async_last=[0, 0, 0, 1])  # async ends at (.75 + .25) / 2 = .5
    systems["oolong_sync"] = tta.system_report(START, [
        _seed([(4, 30, [1, 1, 0, 1]), (8, 60, [1, 1, 1, 1])], 70)])  # sync: 1.0, fast
    report = tta.build_report(systems, {})
    assert report["systems"]["oolong_async"]["final"] == 0.5 == report["target"]
    aims = report["aims"]
    assert not aims["async_final_within_sync_ci"]["met"]  # sync's interval is [1, 1]
    assert not aims["async_target_at_most_0_8_sync"]["met"]
    assert aims["async_target_at_most_0_8_sync"]["ratio"] == pytest.approx(1.0 / 0.25)


def test_seeds_that_saved_different_steps_are_refused():
    tta = _tta()
    with pytest.raises(ValueError, match="same steps"):
        tta.system_report(START, [_seed([(4, 60, [1, 0, 0, 1])], 70),
                                  _seed([(5, 60, [1, 0, 0, 1])], 70)])


@pytest.mark.slow
def test_smoke_trains_three_systems_and_scores_every_point(tmp_path):
    out = tmp_path / "tta.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "time_to_accuracy.py"), "--smoke",
                    "--out", str(out), "--work-dir", str(tmp_path / "work")],
                   check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    report = json.loads(out.read_text())
    assert set(report["systems"]) == {"oolong_async", "oolong_sync", "trl"}
    for s in report["systems"].values():
        assert s["seeds"] == 1 and [p["step"] for p in s["curve"]] == [0, 1, 2]
        assert 0.0 <= s["ci95"][0] <= s["final"] <= s["ci95"][1] <= 1.0
        assert s["minutes_to_target"] is not None
        times = [p["minutes"] for p in s["curve"]]
        assert times == sorted(times) and times[-1] > 0
    assert report["target"] == min(s["final"] for s in report["systems"].values())
    assert set(report["aims"]) == {"async_reaches_trl_final_in_half_trl_time",
                                   "async_final_within_sync_ci", "async_target_at_most_0_8_sync"}
    assert report["held_out_in_train_pool"] == 0
    assert set(report["held_out_in_trained_batches"].values()) == {0.0}
    assert report["task"]["held_out"] == 160 and report["task"]["train_pool"] == 640
    assert len(report["machine"]["load_avg_start"]) == 3
    assert out.with_suffix(".png").stat().st_size > 0
    # every saved point was deleted once scored
    assert not list((tmp_path / "work").rglob("points/step*/model.safetensors"))


def test_a_run_without_trl_reports_the_aims_it_can_and_its_own_target():
    tta = _tta()
    systems = _systems(tta)
    del systems["trl"]
    report = tta.build_report(systems, {})
    assert report["target"] == 0.75 and report["target_from"] == "oolong_sync"
    assert set(report["aims"]) == {"async_final_within_sync_ci", "async_target_at_most_0_8_sync"}
    # async reaches .75 between its step 4 (1 min, .5) and step 8 (2 min, .875): 1 + .25/.375
    assert report["systems"]["oolong_async"]["minutes_to_target"] == pytest.approx(1 + 0.25 / 0.375)
    assert report["systems"]["oolong_sync"]["minutes_to_target"] == pytest.approx(4.0)
