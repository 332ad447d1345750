"""Issue 47, item 4: rewards cannot poison a run. A reward of 1e39 (finite, so the jail's runner
passed it) overflowed the float32 advantages: every parameter NaN, and a 1-step run *succeeded*.
Forged reply lines with NaN, inf, text or lists were accepted; a deeply nested line raised
RecursionError past every handler; an agent returning ``[None]`` killed the run. Now every value
is checked where it enters, and the trainer refuses a non-finite update before it is applied."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from tests.training_core import conftest as fixtures
from tests.training_core.conftest import run_episode
from training_core.api import EpisodeError, NonFiniteUpdate, SamplingParams
from training_core.config import AgentSpec, load_spec
from training_core.reward_failures import RewardsFailing
from training_core.rewards.pool import RewardPool
from training_core.sandbox import JailedWorker
from training_core.train import train

server, tiny_model_dir = fixtures.server, fixtures.tiny_model_dir  # a real embedded server

DEEP = "[" * 30_000 + "]" * 30_000  # within the 64 KB answer cap, deep enough for RecursionError


def _forging(line: str) -> str:
    """A reward that writes ``line`` on the protocol's fd as its own reply, then waits."""
    return ("import os, time\ndef reward(c, i):\n"
            f"    os.write(3, {line!r}.encode() + b'\\n')\n    time.sleep(30)\n    return 0.5\n")


@pytest.mark.parametrize("line", [
    '{"id": 1, "reward": NaN}', '{"id": 1, "reward": Infinity}', '{"id": 1, "reward": -Infinity}',
    '{"id": 1, "reward": "1.0"}', '{"id": 1, "reward": [1.0]}', '{"id": 1, "reward": {"a": 1}}',
    '{"id": 1, "reward": true}', '{"id": true, "reward": 1.0}', '{"id": 1, "reward": 1.0, "x": 2}',
    '{"id": 1, "reward": 1.0, "extracted": [1]}', '{"id": 1, "error": 42}', '{"id": 1}', DEEP,
    '{"id": 1, "reward": ' + DEEP + "}",
])
def test_a_forged_reply_is_a_protocol_failure_of_its_sample(line):
    worker = JailedWorker({"kind": "source", "entrypoint": "reward"}, source=_forging(line))
    try:
        status, answer = worker.call("x", {}, 20)
    finally:
        worker.kill()
    assert (status, answer) == ("protocol", None)


def _score(tmp_path, monkeypatch, source: str, n: int = 2, **pool):
    (tmp_path / "poison_reward.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))

    async def go():
        p = RewardPool("poison_reward:reward", workers=1, timeout_s=20, **pool)
        try:
            return [await p.score("42", {"answer": "42"}) for _ in range(n)]
        finally:
            p.close()

    return asyncio.run(go())


def test_a_recursion_bomb_line_fails_one_sample_and_the_pool_goes_on(tmp_path, monkeypatch):
    """It used to raise RecursionError out of the pool: the episode, then the run, died."""
    source = _forging(DEEP).replace("    os.write", "    if i.get('bomb', True): os.write")
    first, second = _score(tmp_path, monkeypatch, source)
    assert first.reward == 0.0 and "protocol" in first.error
    assert second.reward == 0.0 and "protocol" in second.error  # a fresh jail, the same reward


@pytest.mark.parametrize("value,max_abs,shown", [
    ("1e39", 1e6, "1e+39"), ("-2e6", 1e6, "-2e+06"), ("5.0", 1.0, "5"), ("10**300", 1e6, "1e+300"),
])
def test_a_reward_out_of_range_fails_its_sample_naming_the_value_and_the_bound(
        tmp_path, monkeypatch, value, max_abs, shown):
    results = _score(tmp_path, monkeypatch, f"def reward(c, i):\n    return {value}\n", n=1,
                     max_abs=max_abs)
    (r,) = results
    assert r.reward == 0.0 and r.error.startswith("RewardOutOfRange: ")
    assert "poison_reward:reward" in r.error and shown in r.error and "reward.max_abs" in r.error


def test_within_the_bound_rewards_score_as_before(tmp_path, monkeypatch):
    (r,) = _score(tmp_path, monkeypatch, "def reward(c, i):\n    return -1e6\n", n=1)
    assert (r.reward, r.error) == (-1e6, None)


BASE = ["model.path=tiny", "rollout.max_new_tokens=4", "rollout.max_concurrent=4",
        "rollout.group_size=4", "trainer.batch_groups=1", "trainer.steps=3", "checkpoint.every=0",
        "eval.every=0", "reward.timeout_s=60"]


def test_a_reward_of_1e39_fails_the_run_loudly_naming_the_reward(tmp_path, monkeypatch):
    """The issue's run: with 1e39 every parameter became NaN and a 1-step run succeeded with
    reward/error_frac 0. Now its first step fails the run, naming the function and the value."""
    (tmp_path / "huge_reward.py").write_text("def reward(c, i):\n    return 1e39\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = load_spec(None, BASE + ["trainer.steps=1", "reward.fn=huge_reward:reward",
                                   f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(RewardsFailing, match=r"out of range.*huge_reward:reward' returned 1e\+39, "
                                             r"outside \+-1e\+06 \(reward.max_abs\)"):
        train(spec, progress=False)
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e.get("kind") == "failed"]
    assert failed and "huge_reward:reward" in failed[-1]["message"]


POISON_WORKFLOW = '''
from training_core.workflows.rlvr import RLVRWorkflow


class Poison(RLVRWorkflow):
    """A workflow (an administrator's module) whose rewards reach the batch unchecked."""

    async def arun_episode(self, engine, item):
        group = await super().arun_episode(engine, item)
        group.samples[0].reward = float("inf")
        return group
'''


def test_non_finite_advantages_are_refused_and_a_repeat_fails_the_run(tmp_path, monkeypatch):
    (tmp_path / "poison_wf.py").write_text(POISON_WORKFLOW)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = load_spec(None, BASE + ["rollout.workflow=poison_wf:Poison",
                                   f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(NonFiniteUpdate, match=r"2 consecutive updates refused.*non-finite "
                                              r"rewards.*rollout.workflow 'poison_wf:Poison'"
                                              r".*1 of 4 not finite"):
        train(spec, progress=False)
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("kind") == "update_refused"] == [1, 2]
    # Nothing was exported or pushed: the refusal came before the optimizer step.
    weights = tmp_path / "run" / "weights"
    assert not weights.exists() or not [p for p in weights.rglob("*") if p.is_file()]


def _batch(n=4, length=10, prompt=5):
    from training_core.api import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (n, length), generator=g)
    mask = torch.zeros(n, length)
    mask[:, prompt:] = 1
    adv = torch.tensor([1.0, -1.0] * (n // 2)).view(-1, 1) * mask
    return TrainBatch(ids, torch.ones(n, length, dtype=torch.long), mask, torch.zeros(n, length),
                      torch.zeros(n, length, dtype=torch.long), adv)


def test_the_trainer_refuses_a_non_finite_update_before_the_optimizer_step(tiny_model_dir):
    from training_core.algorithms.loss import decoupled_ppo_loss
    from training_core.algorithms.presets import PRESETS
    from training_core.trainer.deepspeed_trainer import DeepSpeedTrainer

    trainer = DeepSpeedTrainer(tiny_model_dir, lr=1e-2, weight_decay=0.0, grad_clip=1.0,
                               zero_stage=0, micro_batch_tokens=1000)
    weights = {k: v.clone() for k, v in trainer.engine.module.state_dict().items()}

    def loss_fn(*a, **k):
        return decoupled_ppo_loss(*a, cfg=PRESETS["grpo"], **k)

    def nan_loss(*a, **k):
        value, stats = loss_fn(*a, **k)
        return value * float("nan"), stats

    bad_adv = _batch()
    bad_adv.advantages[0, -1] = float("inf")
    for batch, fn, what in ((bad_adv, loss_fn, "advantages"), (_batch(), nan_loss, "loss")):
        with pytest.raises(NonFiniteUpdate, match=f"non-finite {what}"):
            trainer.train_step(batch, None, fn)
        for k, v in trainer.engine.module.state_dict().items():
            assert torch.equal(v, weights[k]), f"{k} changed by a refused update"
    stats = trainer.train_step(_batch(), None, loss_fn)  # the next update starts clean
    assert stats["grad_norm"] > 0
    moved = trainer.engine.module.state_dict()
    assert all(torch.isfinite(v).all() for v in moved.values())
    assert any(not torch.equal(v, weights[k]) for k, v in moved.items())


AGENTS = "tests/security/attack_agents.py"


def _agent(tiny_model_dir, entry):
    from training_core.models.loading import load_tokenizer
    from training_core.workflows import load_workflow
    from training_core.workflows.base import WorkflowContext

    ctx = WorkflowContext(tokenizer=load_tokenizer(tiny_model_dir), rewards=None,  # type: ignore[arg-type]
                          sampling=SamplingParams(max_new_tokens=4), group_size=1,
                          agent=AgentSpec(timeout_s=90, retries=0))
    return load_workflow(f"agent:{AGENTS}:{entry}", ctx)


@pytest.mark.parametrize("entry,reason", [
    ("returns_none_list", r"reward returned NoneType, not a number"),
    ("returns_huge", r"returned 1e\+39, outside \+-1e\+06 \(reward.max_abs\)"),
    ("returns_sum_to_inf", r"return of turn 0 \(rewards summed\) returned 1.8e\+06"),
    ("returns_nan_text", r"the agent's jail answered garbage"),
])
def test_a_bad_agent_return_drops_its_group_not_the_run(server, tiny_model_dir, entry, reason):
    """``[None]`` raised TypeError out of the episode, which killed the run; per-turn rewards
    summed to inf; a forged NaN line was taken."""
    with pytest.raises(EpisodeError, match=r"group dropped: 1 of 1 episodes failed 1 times.*" + reason):
        run_episode(server, _agent(tiny_model_dir, entry), {"question": "1+1="})
