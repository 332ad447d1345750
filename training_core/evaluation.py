"""Greedy evaluation: accuracy and mean reward on held-out rows.

Two ways to generate, one way to prompt and to score: prompts are rendered like training's
(``render_prompt``: the template and the chat template), completions are scored by the run's
reward with its answer extraction, and both report :func:`eval_metrics`.

- :func:`evaluate` generates through the rollout servers, beside training (train.py).
- ``offline_eval.evaluate_weights`` loads a run's pushed weights into an embedded engine in this
  process and generates every row at once: the offline evaluation job (a Celery worker runs it
  for the web app).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from training_core.api import EpisodeError, GenerationRequest, InferenceEngine, SamplingParams
from training_core.metric_names import EVAL_ERRORS
from training_core.workflows.base import WorkflowContext

CORRECT = 1.0 - 1e-6  # a reward this high counts as a correct answer

log = logging.getLogger(__name__)


def eval_metrics(rewards: list[float], prefix: str = "eval") -> dict[str, float]:
    if not rewards:
        return {}
    return {f"{prefix}/accuracy": sum(r >= CORRECT for r in rewards) / len(rewards),
            f"{prefix}/reward": sum(rewards) / len(rewards)}


async def evaluate(client: InferenceEngine, ctx: WorkflowContext, rows: list[dict[str, Any]],
                   max_new_tokens: int, errors: list[str] | None = None) -> dict[str, float]:
    """Greedy accuracy on held-out rows, through the same servers (runs beside training).

    A row whose episode fails (a prompt too long for the server, a request it rejects) scores 0
    and is counted in ``eval/errors``: one bad eval row must not fail the run. Servers that stay
    unreachable (``RolloutServerError``) still fail it. Accuracy keeps every row in its
    denominator, so evaluations stay comparable. The failed rows' messages are appended to
    ``errors`` when it is given."""
    greedy = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    failed: list[str] = []

    async def one(item: dict[str, Any]) -> float:
        try:
            if ctx.evaluate_episode is not None:  # an agent: its own greedy episode
                return float(await ctx.evaluate_episode(client, item))
            resp = await client.agenerate(GenerationRequest(ctx.render_prompt(item), greedy))
            return (await ctx.rewards.score(ctx.decode(resp.output_ids), item)).reward
        except EpisodeError as exc:  # this row's fault; a server down still fails the run
            failed.append(f"{type(exc).__name__}: {exc}")
            return 0.0

    scores = list(await asyncio.gather(*[one(r) for r in rows]))
    if failed:
        log.warning("evaluation: %d of %d rows failed (scored 0); first: %s", len(failed),
                    len(rows), failed[0])
        if errors is not None:
            errors.extend(failed)
    out = eval_metrics(scores)
    return {**out, EVAL_ERRORS: float(len(failed))} if out else out
