"""Refused updates (issue 47): the trainer never steps on a non-finite advantage, loss or
gradient (``NonFiniteUpdate``, raised before the optimizer step and so before any push). One
refused batch is skipped and evented; when it repeats the run fails, naming where the rewards
came from and what they were, instead of training on NaN (a reward of 1e39 once made every
parameter NaN and the run "succeeded").
"""

from __future__ import annotations

import math
from typing import Any

from training_core.api import MetricsSink, NonFiniteUpdate, TrajectoryGroup
from training_core.config import RunSpec

MAX_CONSECUTIVE = 2  # the second refusal in a row fails the run


def reward_source(spec: RunSpec) -> str:
    """Where a run's rewards come from, as the user would name it."""
    workflow = spec.rollout.workflow
    if spec.rollout.mode == "online":
        return "the rewards online agents posted"
    if workflow.startswith("agent:"):
        return f"the agent {workflow.removeprefix('agent:')!r} (rollout.workflow)"
    named = f"reward.fn {spec.reward.fn!r}"
    return named if ":" not in workflow else f"{named} through rollout.workflow {workflow!r}"


def describe_rewards(groups: list[TrajectoryGroup]) -> str:
    rewards = [s.reward for g in groups for s in g.samples]
    finite = [r for r in rewards if math.isfinite(r)]
    text = (f"ranged from {min(finite):g} to {max(finite):g}" if finite else "had no finite value")
    wild = len(rewards) - len(finite)
    return text + (f", {wild} of {len(rewards)} not finite" if wild else "")


class UpdateRefusals:
    def __init__(self, spec: RunSpec, sink: MetricsSink, limit: int = MAX_CONSECUTIVE):
        self.spec, self.sink, self.limit = spec, sink, limit
        self.streak = 0

    def refused(self, exc: NonFiniteUpdate, groups: list[TrajectoryGroup], step: int) -> None:
        """Record a refused step; raise once refusals repeat."""
        self.streak += 1
        message = (f"step {step}: {exc}; the batch's rewards ({reward_source(self.spec)}) "
                   f"{describe_rewards(groups)}")
        self.sink.event("update_refused", message[:2000], step=step)
        if self.streak >= self.limit:
            raise NonFiniteUpdate(f"{self.streak} consecutive updates refused for non-finite "
                                  f"values; last: {message}") from exc

    def rewards_refused(self, groups: list[TrajectoryGroup], step: int, world: int) -> bool:
        """True if the batch holds a non-finite reward (a workflow's own; the reward pool and
        the agents' returns admit none): its update is refused before anything is computed.
        With several ranks they wait for this batch's share, so the run fails at once."""
        if all(math.isfinite(s.reward) for g in groups for s in g.samples):
            return False
        if world > 1:
            self.streak = self.limit - 1
        self.refused(NonFiniteUpdate("non-finite rewards in this batch: its update was refused"),
                     groups, step)
        return True

    def accepted(self, *_: Any) -> None:
        self.streak = 0
