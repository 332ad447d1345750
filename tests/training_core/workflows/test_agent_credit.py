"""Per-turn credit of agent episodes is bounded by construction (issue 51.1): uniform groups get
exactly zero, near-uniform and varied groups stay within a few units, for every preset and
discount, with one reward per episode or one per completion; ppo_kl's baseline is the batch's.
And a real agent run on a task every episode solves trains with loss and gradient norm zero."""

from __future__ import annotations

import json

import pytest

from training_core.algorithms.presets import PRESETS, resolve_algorithm
from training_core.api import Trajectory, TrajectoryGroup
from training_core.gateway.credit import segment_advantages, turn_returns

DISCOUNTS = [1.0, 0.9, 0.5]


def episode(ep: int, reward, turns: int, discount: float) -> Trajectory:
    """One segment: a prompt token, then two sampled tokens per turn with a prompt token between
    turns (a tool result)."""
    returns = turn_returns(reward, turns, discount)
    mask, token_returns = [0], [0.0]
    for t in range(turns):
        mask += [1, 1] + ([0] if t < turns - 1 else [])
        token_returns += [returns[t]] * 2 + ([0.0] if t < turns - 1 else [])
    n = len(mask)
    return Trajectory([1] * n, mask, [0.0] * n, [0] * n, returns[0],
                      info={"episode": ep, "episode_return": returns[0],
                            "token_returns": token_returns})


def group(rewards, turns, discount) -> TrajectoryGroup:
    return TrajectoryGroup([episode(i, r, t, discount)
                            for i, (r, t) in enumerate(zip(rewards, turns, strict=True))])


def by_turn(row: list[float], mask: list[int]) -> list[float]:
    return [a for a, m in zip(row, mask, strict=True) if m][::2]  # one value per turn


@pytest.mark.parametrize("discount", DISCOUNTS)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_uniform_group_gets_exactly_zero(preset, discount):
    algo = resolve_algorithm(preset)
    for rewards, turns in [([1.0] * 4, [2] * 4), ([[0.5, 0.5]] * 4, [2] * 4),
                           ([0.0] * 4, [3] * 4), ([7.0] * 2, [4] * 2)]:
        adv = segment_advantages([group(rewards, turns, discount)], algo)
        assert all(a == 0.0 for row in adv for a in row), (rewards, adv)


@pytest.mark.parametrize("discount", DISCOUNTS)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_near_uniform_group_stays_bounded_and_ranks_the_worse_episode_last(preset, discount):
    algo = resolve_algorithm(preset)
    g = group([1.0, 1.0, 1.0, 0.99], [2] * 4, discount)
    adv = segment_advantages([g], algo)
    flat = [a for row in adv for a in row]
    assert max(abs(a) for a in flat) <= 4.0, flat  # was ~26 (and 1e5 for a uniform group)
    turns = [by_turn(row, s.loss_mask) for row, s in zip(adv, g.samples, strict=True)]
    for t in range(2):  # at every turn the worse episode is below each better one
        assert all(turns[3][t] < turns[i][t] for i in range(3))
    assert turns[3][0] < 0


@pytest.mark.parametrize("per_completion", [False, True])
@pytest.mark.parametrize("discount", DISCOUNTS)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_varied_group_is_bounded_and_signed_by_outcome(preset, discount, per_completion):
    algo = resolve_algorithm(preset)
    turns = [2, 3, 2, 3]
    rewards = [1.0, 0.0, 1.0, 0.0]
    if per_completion:  # the reward at the last completion, as a list
        rewards = [[0.0] * (t - 1) + [r] for r, t in zip(rewards, turns, strict=True)]
    g = group(rewards, turns, discount)
    adv = segment_advantages([g], algo)
    bound = 4.0 if algo.normalize_std else 2.0
    assert max(abs(a) for row in adv for a in row) <= bound
    for row, s, won in zip(adv, g.samples, [True, False, True, False], strict=True):
        assert all((a > 0) == won for a in by_turn(row, s.loss_mask)), (preset, row)
        assert all(a == 0.0 for a, m in zip(row, s.loss_mask, strict=True) if not m)


def test_the_reported_explosion_is_gone():
    """Issue 51.1: gamma 0.9, two turns, every episode 1.0 gave the last turn ~100,000."""
    adv = segment_advantages([group([1.0] * 4, [2] * 4, 0.9)], resolve_algorithm("grpo"))
    assert max(abs(a) for row in adv for a in row) == 0.0


def test_ppo_kl_baselines_against_the_batch_and_the_group_presets_against_the_group():
    groups = [group([1.0, 1.0], [2, 2], 1.0), group([0.0, 0.0], [2, 2], 1.0)]
    ppo = segment_advantages(groups, resolve_algorithm("ppo_kl"))
    assert {a for row in ppo[:2] for a in row if a} == {0.5}  # 1.0 - the batch mean 0.5
    assert {a for row in ppo[2:] for a in row if a} == {-0.5}
    for preset in ("grpo", "dr_grpo", "rloo"):  # each group is uniform on its own
        assert all(a == 0.0 for row in segment_advantages(groups, resolve_algorithm(preset))
                   for a in row)


@pytest.mark.slow
def test_an_agent_run_on_a_solved_task_trains_with_zero_loss_and_gradient(tmp_path):
    from training_core.config import load_spec
    from training_core.train import train

    spec = load_spec(None, [
        f"run_dir={tmp_path / 'run'}",
        "rollout.workflow=agent:tests/training_core/agents/probe_agent.py:solved",
        "rollout.agent.discount=0.9", "rollout.group_size=2", "rollout.max_new_tokens=4",
        "rollout.max_concurrent=2", "trainer.batch_groups=1", "trainer.steps=2",
        "eval.every=0", "checkpoint.every=0", "reward.executor=inline",
        "rollout.agent.timeout_s=60"])
    train(spec, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert len(rows) == 2
    for r in rows:
        assert r["reward/mean"] == pytest.approx(0.9) and r["agent/turns"] == 2  # 0.9 * 1.0
        assert r["advantage/abs_max"] == 0.0
        assert abs(r["loss"]) < 1e-6 and r["grad_norm"] < 1e-6, r


def test_an_agents_own_temperatures_reach_the_train_batch():
    from training_core.batching import build_train_batch

    g = group([1.0, 0.0], [2, 2], 1.0)
    assert build_train_batch([g], pad_id=0, algo=resolve_algorithm("grpo"),
                             max_new_tokens=8).temperatures is None
    g.samples[1].info["token_temperatures"] = [0.0] * 3 + [0.5] * 3
    tb = build_train_batch([g], pad_id=0, algo=resolve_algorithm("grpo"), max_new_tokens=8)
    assert tb.temperatures.tolist() == [[0.0] * 6, [0.0] * 3 + [0.5] * 3]
