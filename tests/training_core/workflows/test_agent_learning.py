"""Reward rises through the gateway: a real training run whose episodes are jailed agents
using the openai package (tiny model, CPU, a couple of minutes)."""

from __future__ import annotations

import json
import statistics

import pytest

from training_core.config import load_spec
from training_core.train import train


@pytest.mark.slow
def test_reward_rises_through_the_gateway(tmp_path):
    spec = load_spec(None, [
        f"run_dir={tmp_path / 'run'}",
        # Two turns per episode; the agent rewards the share of digits the model writes (a task
        # a randomly initialised model can learn in seconds: ~10% of its characters at first).
        "rollout.workflow=agent:tests/training_core/agents/probe_agent.py:digits",
        "rollout.group_size=4", "rollout.max_new_tokens=8", "rollout.max_concurrent=8",
        "trainer.batch_groups=2", "trainer.steps=12", "trainer.lr=3e-3", "eval.every=0",
        "checkpoint.every=0", "reward.executor=inline", "rollout.agent.timeout_s=60"])
    train(spec, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert len(rows) == 12
    rewards = [r["reward/mean"] for r in rows]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last > first + 0.05, rewards
    assert all(r["agent/turns"] == 2 and r["rollout/episode_errors"] == 0 for r in rows)
    # The viewer's samples carry the conversation turn by turn.
    sample = [json.loads(line) for line in (tmp_path / "run" / "trajectories.jsonl").open()][-1]
    turns = sample["info"]["turns"]
    assert [t["turn"] for t in turns] == [0, 1]
    assert turns[1]["new_messages"][-1] == {"role": "user", "content": "more"}
    assert sample["completion"] == " | ".join(t["completion"] for t in turns)
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").open()]
    assert events[-1]["kind"] == "finished"
