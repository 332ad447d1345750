"""Workflows: one episode as one coroutine (see base.py). ``rollout.workflow`` names one of these,
a ``package.module:Class`` of the user's, or an agent, ``agent:<module>:<callable>`` (agent.py)."""

from __future__ import annotations

from training_core.api import Workflow
from training_core.imports import import_string
from training_core.workflows.base import WorkflowContext

WORKFLOWS = {
    "rlvr": "training_core.workflows.rlvr:RLVRWorkflow",
    "multi_turn": "training_core.workflows.multi_turn:MultiTurnWorkflow",
}


def load_workflow(name: str, ctx: WorkflowContext) -> Workflow:
    if name == "online":  # rollout.mode: online (agents elsewhere post their rewards)
        from training_core.workflows.online import OnlineWorkflow

        return OnlineWorkflow(ctx)
    if name.startswith("agent:"):
        from training_core.workflows.agent import AgentWorkflow

        return AgentWorkflow(ctx, name.removeprefix("agent:"))
    if ":" not in name and name not in WORKFLOWS:
        raise ValueError(f"rollout.workflow {name!r}: use {', '.join(WORKFLOWS)} or module:Class")
    return import_string(WORKFLOWS.get(name, name), field="rollout.workflow", kind="class")(ctx)
