"""Multi-turn: the model answers; if wrong it is told so and retries, up to ``max_turns``.

The reward of a correct answer at turn k (0-based) is ``turn_discount ** k``. The trajectory is
the whole conversation; only the model's own tokens are trained on (feedback tokens are masked).
"""

from __future__ import annotations

import asyncio
from typing import Any

from training_core.api import (
    PROMPT_VERSION,
    GenerationRequest,
    InferenceEngine,
    Trajectory,
    TrajectoryGroup,
)
from training_core.workflows.base import WorkflowContext

FEEDBACK = " Wrong, try again: "


class MultiTurnWorkflow:
    def __init__(self, ctx: WorkflowContext):
        self.ctx = ctx
        # The model's EOS stays in the conversation: it was generated and is trained on.
        self.feedback_ids = list(ctx.tokenizer.encode(FEEDBACK, add_special_tokens=False))

    async def _conversation(self, engine: InferenceEngine, item: dict[str, Any]) -> Trajectory:
        ids = self.ctx.render_prompt(item)
        mask, lps, vers = [0] * len(ids), [0.0] * len(ids), [PROMPT_VERSION] * len(ids)
        reward, truncated, completions, interruptions = 0.0, False, [], 0
        clamped = False
        reward_error: str | None = None  # the first turn whose reward failed (counted per sample)
        for turn in range(self.ctx.max_turns):
            resp = await engine.agenerate(GenerationRequest(list(ids), self.ctx.sampling))
            text = self.ctx.decode(resp.output_ids)
            completions.append(text)
            interruptions += resp.interruptions
            clamped = clamped or resp.budget_clamped
            ids += resp.output_ids
            mask += [1] * len(resp.output_ids)
            lps += resp.output_logprobs
            vers += resp.output_versions
            truncated = resp.finish_reason == "length"
            scored = await self.ctx.rewards.score(text, item)
            reward_error = reward_error or scored.error
            if scored.reward > 0:
                reward = scored.reward * self.ctx.turn_discount**turn
                break
            if turn + 1 < self.ctx.max_turns:
                ids += self.feedback_ids
                mask += [0] * len(self.feedback_ids)
                lps += [0.0] * len(self.feedback_ids)
                vers += [PROMPT_VERSION] * len(self.feedback_ids)
        return Trajectory(ids, mask, lps, vers, reward, truncated,
                          info={"completion": " | ".join(completions), "turns": len(completions),
                                "interruptions": interruptions, "reward_error": reward_error,
                                "budget_clamped": clamped})

    async def arun_episode(self, engine: InferenceEngine, item: dict[str, Any]) -> TrajectoryGroup | None:
        samples = await asyncio.gather(
            *[self._conversation(engine, item) for _ in range(self.ctx.group_size)]
        )
        return TrajectoryGroup(samples=list(samples))
