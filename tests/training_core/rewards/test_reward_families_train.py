"""Rewards that work where they run, through a short real training run (tiny model, embedded
server, trainer, the jailed reward pool): no reward of the run fails. The tiny model answers
badly, so the rewards are mostly 0; what is checked is that every one was scored, not errored."""

from __future__ import annotations

import pytest

from training_core.config import load_spec
from training_core.metrics import read_metrics
from training_core.train import train

BASE = ["model.path=tiny", "rollout.max_new_tokens=8", "rollout.max_concurrent=8",
        "rollout.group_size=4", "trainer.batch_groups=2", "trainer.lr=1e-3", "trainer.steps=2",
        "checkpoint.every=0", "eval.every=0", "reward.executor=process", "reward.timeout_s=60"]


def _run(tmp_path, overrides: list[str]) -> list[dict]:
    spec = load_spec(None, BASE + [f"run_dir={tmp_path / 'run'}"] + overrides)
    result = train(spec, progress=False)
    steps = [r for r in read_metrics(result.run_dir) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2], steps
    return steps


def _assert_no_reward_failed(steps: list[dict]) -> None:
    for row in steps:
        assert row["reward/errors"] == 0 and row["reward/error_frac"] == 0.0, row


@pytest.mark.slow
def test_a_reasoning_gym_run_scores_every_reward(tmp_path):
    steps = _run(tmp_path, ["data.source=reasoning_gym:basic_arithmetic", "data.size=32",
                            "data.prompt_template=reasoning_gym", "reward.fn=builtin:reasoning_gym"])
    _assert_no_reward_failed(steps)


@pytest.mark.slow
def test_a_user_reward_run_with_ssl_urllib_numpy_scores_every_reward(tmp_path, monkeypatch):
    from tests.training_core.rewards.test_reward_families import USER_REWARD

    (tmp_path / "user_scorer_run.py").write_text(USER_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    steps = _run(tmp_path, ["data.options={max_value: 9}", "reward.fn=user_scorer_run:reward"])
    _assert_no_reward_failed(steps)
    # The score is a real function of the completion (exp(-distance)): not all zeros.
    assert any(row["reward/mean"] > 0 for row in steps), steps
