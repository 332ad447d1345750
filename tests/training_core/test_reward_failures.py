"""Reward failures are visible: the per-step error fraction, one event per kind of error, and a
run that fails with the reason when most rewards keep failing."""

from __future__ import annotations

import json
import statistics

import pytest

from training_core.config import SpecError, load_spec
from training_core.metric_names import REWARD_ERROR_FRAC
from training_core.metrics import read_metrics
from training_core.reward_failures import RewardFailureWatch, RewardsFailing, error_kind


def test_error_kinds_are_evented_once_and_the_fraction_is_per_step():
    watch = RewardFailureWatch(max_failing_steps=3)
    frac, new = watch.observe([None, "TypeError: bad", None, "TypeError: other text"])
    assert frac == 0.5 and new == [("TypeError", "TypeError: bad")]
    frac, new = watch.observe(["reward timed out after 10 s", "TypeError: again", None, None])
    assert frac == 0.5 and new == [("reward timed out after 10 s", "reward timed out after 10 s")]
    watch.check()  # exactly half is not "more than half"


def test_the_run_fails_after_max_failing_steps_consecutive_bad_steps():
    watch = RewardFailureWatch(max_failing_steps=3)
    bad, good = ["KeyError: 'answer'"] * 3 + [None], [None] * 4
    for errors in (bad, bad, good, bad, bad):  # a good step resets the count
        watch.observe(errors)
        watch.check()
    watch.observe(bad)
    with pytest.raises(RewardsFailing, match=r"3 consecutive steps .*first error: KeyError"):
        watch.check()


def test_error_kind_is_the_text_before_the_colon():
    assert error_kind("ZeroDivisionError: division by zero") == "ZeroDivisionError"
    assert error_kind("") == "error"


def test_max_failing_steps_is_validated_with_its_key():
    assert load_spec(None, []).reward.max_failing_steps == 3
    with pytest.raises(SpecError) as err:
        load_spec(None, ["reward.max_failing_steps=0"])
    assert "reward.max_failing_steps" in err.value.errors


SMALL = [
    "model.path=tiny", "data.options={max_value: 9}", "rollout.max_new_tokens=8",
    "rollout.max_concurrent=8", "rollout.group_size=4", "trainer.batch_groups=2",
    "eval.every=0", "checkpoint.every=0", "reward.executor=process", "reward.workers=1",
]


def _events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").open()]


@pytest.mark.slow
def test_a_reward_that_always_raises_fails_the_run_with_the_reason(tmp_path):
    from training_core.train import train

    spec = load_spec(None, SMALL + [
        f"run_dir={tmp_path / 'run'}", "trainer.steps=20", "reward.max_failing_steps=2",
        "reward.fn=tests.training_core.rewards_for_tests:raises"])
    with pytest.raises(RewardsFailing, match="user reward bug"):
        train(spec, progress=False)
    events = _events(tmp_path / "run")
    errors = [e for e in events if e["kind"] == "reward_error"]
    assert len(errors) == 1 and errors[0]["error_kind"] == "RuntimeError"
    assert "user reward bug" in errors[0]["message"]
    failed = events[-1]
    assert failed["kind"] == "failed" and failed["step"] == 2
    assert "consecutive steps" in failed["message"] and "user reward bug" in failed["message"]
    # step 1 was logged with every reward failed; the run stopped at step 2, before training it
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1] and rows[0][REWARD_ERROR_FRAC] == 1.0


@pytest.mark.slow
def test_a_reward_failing_a_third_of_samples_keeps_running_and_reports_it(tmp_path):
    from training_core.metric_names import MISMATCH
    from training_core.train import train

    spec = load_spec(None, SMALL + [
        f"run_dir={tmp_path / 'run'}", "trainer.steps=4", "rollout.max_staleness=0",
        "reward.fn=tests.training_core.rewards_failing:fails_every_third"])
    result = train(spec, progress=False)
    rows = [r for r in read_metrics(result.run_dir) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    fracs = [r[REWARD_ERROR_FRAC] for r in rows]
    # 8 samples a step, every third reward call fails: 2 or 3 of 8 per step
    assert all(0.2 <= f <= 0.4 for f in fracs), fracs
    assert statistics.fmean(fracs) == pytest.approx(1 / 3, abs=0.06)
    events = _events(result.run_dir)
    assert [e["error_kind"] for e in events if e["kind"] == "reward_error"] == ["ValueError"]
    assert events[-1]["kind"] == "finished"
    # The mismatch metrics are on every step. Synchronous (max_staleness 0) on the embedded
    # fp32 server, behaviour and proximal policies are the same up to float error.
    for r in rows:
        assert set(MISMATCH.ALL) <= r.keys()
        assert 0 <= r[MISMATCH.kl_k3] < 1e-6 and r[MISMATCH.abs_logp_diff_max] < 1e-4
        assert r[MISMATCH.ess] == pytest.approx(1.0, abs=1e-6)
        assert r[MISMATCH.removed_frac] == 0.0
