"""Single-turn RL from verifiable rewards: prompt -> n samples -> rewards -> trajectories."""

from __future__ import annotations

import asyncio
from typing import Any

from training_core.api import GenerationRequest, InferenceEngine, TrajectoryGroup
from training_core.workflows.base import WorkflowContext, single_turn_trajectory


class RLVRWorkflow:
    def __init__(self, ctx: WorkflowContext):
        self.ctx = ctx

    async def _score(self, resp, item: dict[str, Any]):
        text = self.ctx.decode(resp.output_ids)
        scored = await self.ctx.rewards.score(text, item)
        return single_turn_trajectory(resp, scored.reward, completion=text,
                                      reward_error=scored.error, extracted=scored.extracted)

    async def arun_episode(self, engine: InferenceEngine, item: dict[str, Any]) -> TrajectoryGroup | None:
        request = GenerationRequest(self.ctx.render_prompt(item), self.ctx.sampling)
        n = self.ctx.group_size
        responses = await engine.agenerate_group(request, n)  # one batched request
        samples = await asyncio.gather(*[self._score(r, item) for r in responses])
        return TrajectoryGroup(samples=list(samples))
