"""Workflows against a real embedded server."""

from __future__ import annotations

import asyncio

from tests.training_core.conftest import run_episode
from training_core.api import PROMPT_VERSION, SamplingParams
from training_core.models.loading import load_tokenizer
from training_core.rewards.pool import RewardPool
from training_core.workflows import load_workflow
from training_core.workflows.base import WorkflowContext


def _ctx(tiny_model_dir, fn, **kw):
    return WorkflowContext(tokenizer=load_tokenizer(tiny_model_dir),
                           # Function rewards run only in the sandbox jail (executor process).
                           rewards=RewardPool(fn, executor="inline" if fn.startswith("builtin:")
                                              else "process"),
                           sampling=SamplingParams(max_new_tokens=5, ignore_eos=True),
                           group_size=3, **kw)


def test_rlvr_group_has_consistent_tensors(server, tiny_model_dir):
    ctx = _ctx(tiny_model_dir, "tests.training_core.rewards_for_tests:length_reward")
    group = run_episode(server, load_workflow("rlvr", ctx), {"question": "1+2=", "answer": "3"})
    assert len(group.samples) == 3
    for s in group.samples:
        n_prompt = len(ctx.render_prompt({"question": "1+2="}))
        assert s.loss_mask == [0] * n_prompt + [1] * 5
        assert s.versions[:n_prompt] == [PROMPT_VERSION] * n_prompt
        assert all(v == 0 for v in s.versions[n_prompt:])
        assert s.reward == len(s.info["completion"]) / 10


def test_multi_turn_masks_feedback_and_discounts(server, tiny_model_dir):
    ctx = _ctx(tiny_model_dir, "builtin:exact", max_turns=3, turn_discount=0.5)
    group = run_episode(server, load_workflow("multi_turn", ctx), {"question": "1+2=", "answer": "no way"})
    feedback = ctx.tokenizer.encode(" Wrong, try again: ", add_special_tokens=False)
    for s in group.samples:
        assert s.info["turns"] == 3 and s.reward == 0.0
        assert s.num_output_tokens == 15  # three model turns of 5 tokens
        # Feedback tokens sit in the trajectory but are not trained on.
        masked = [t for t, m in zip(s.input_ids, s.loss_mask, strict=True) if not m]
        assert masked[-len(feedback):] == feedback


class _ScriptedEngine:
    """Answers from a script, one per call (the InferenceEngine Protocol, no server)."""

    def __init__(self, tokenizer, answers):
        self.tok, self.answers, self.version = tokenizer, list(answers), 0

    async def agenerate(self, request):
        from training_core.api import GenerationResponse

        ids = self.tok.encode(self.answers.pop(0), add_special_tokens=False)
        return GenerationResponse(request.input_ids, ids, [-0.1] * len(ids), [0] * len(ids), "stop")


def test_multi_turn_reward_is_discounted_by_the_turn_it_succeeds(tiny_model_dir):
    ctx = _ctx(tiny_model_dir, "builtin:exact", max_turns=3, turn_discount=0.5)
    ctx.group_size = 1
    wf = load_workflow("multi_turn", ctx)
    engine = _ScriptedEngine(ctx.tokenizer, ["4", "5", "3"])
    group = asyncio.run(wf.arun_episode(engine, {"question": "1+2=", "answer": "3"}))
    assert group.samples[0].reward == 0.25 and group.samples[0].info["turns"] == 3
    engine = _ScriptedEngine(ctx.tokenizer, ["3"])
    group = asyncio.run(wf.arun_episode(engine, {"question": "1+2=", "answer": "3"}))
    assert group.samples[0].reward == 1.0 and group.samples[0].info["turns"] == 1


def test_multi_turn_counts_a_turn_whose_reward_failed(tiny_model_dir):
    # The run's reward/error_frac and its failing-rewards rule read info["reward_error"].
    ctx = _ctx(tiny_model_dir, "tests.training_core.rewards_failing:fails_every_third",
               max_turns=3, turn_discount=1.0)
    ctx.group_size = 1
    wf = load_workflow("multi_turn", ctx)
    try:
        # Answers without digits score 0, so all three turns are scored: the third call raises.
        engine = _ScriptedEngine(ctx.tokenizer, ["a", "b", "c"])
        group = asyncio.run(wf.arun_episode(engine, {"question": "1+2=", "answer": "3"}))
    finally:
        ctx.rewards.close()
    sample = group.samples[0]
    assert sample.info["turns"] == 3
    assert "every third sample fails" in sample.info["reward_error"]
