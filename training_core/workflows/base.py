"""Shared pieces of workflows: prompt rendering, stitching trajectories, loading by path.

To write a new task, implement the :class:`training_core.api.Workflow` Protocol in one file
(the registry of named workflows is ``training_core.workflows``):

    class MyWorkflow:
        def __init__(self, ctx: WorkflowContext): ...
        async def arun_episode(self, engine, item) -> TrajectoryGroup | None: ...

and point ``rollout.workflow`` at ``my_package.my_module:MyWorkflow``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from training_core.api import PROMPT_VERSION, GenerationResponse, SamplingParams, Trajectory
from training_core.data.templates import prompt_template_text
from training_core.rewards.pool import RewardPool


@dataclass
class WorkflowContext:
    tokenizer: Any
    rewards: RewardPool
    sampling: SamplingParams
    group_size: int
    prompt_template: str = "{question}"
    chat_template: bool = False
    max_turns: int = 2
    turn_discount: float = 0.9
    agent: Any = None  # rollout.agent (config.AgentSpec): the agent workflow's limits and credit
    # ``async (engine, item) -> reward``: how evaluation scores a row when the workflow has its
    # own episodes (agents: a greedy episode through the gateway); None: a greedy completion of
    # the rendered prompt, scored by the run's reward.
    evaluate_episode: Any = None

    def render_prompt(self, item: dict[str, Any]) -> list[int]:
        return render_prompt(self.tokenizer, item, self.prompt_template, self.chat_template)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def render_prompt(tokenizer: Any, item: dict[str, Any], template: str,
                  chat_template: bool) -> list[int]:
    """Prompt token ids for a dataset row: ``data.prompt_template`` (or a named one) filled with
    the row, wrapped in the model's chat template when ``data.chat_template`` is on."""
    text = prompt_template_text(template).format(**item)
    if chat_template:
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
            return_dict=False))
    return list(tokenizer.encode(text, add_special_tokens=False))


def single_turn_trajectory(resp: GenerationResponse, reward: float, **info: Any) -> Trajectory:
    n_prompt, n_out = len(resp.input_ids), len(resp.output_ids)
    return Trajectory(
        input_ids=resp.input_ids + resp.output_ids,
        loss_mask=[0] * n_prompt + [1] * n_out,
        logprobs=[0.0] * n_prompt + resp.output_logprobs,
        versions=[PROMPT_VERSION] * n_prompt + resp.output_versions,
        reward=reward,
        truncated=resp.finish_reason == "length",
        info={"interruptions": resp.interruptions, "budget_clamped": resp.budget_clamped, **info},
    )
