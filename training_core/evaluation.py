"""Greedy evaluation: accuracy and mean reward on held-out rows.

Two ways to generate, one way to prompt and to score: prompts are rendered like training's
(``render_prompt``: the template and the chat template), completions are scored by the run's
reward with its answer extraction, and both report :func:`eval_metrics`.

- :func:`evaluate` generates through the rollout servers, beside training (train.py).
- :func:`evaluate_weights` loads a model with a run's pushed weights and generates in-process:
  the offline evaluation job (a Celery worker runs it for the web app).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from training_core.api import GenerationRequest, InferenceEngine, SamplingParams
from training_core.config import RunSpec
from training_core.engines.rollout_client import EpisodeError
from training_core.metric_names import EVAL_ERRORS
from training_core.rewards.registry import resolve_reward
from training_core.workflows.base import WorkflowContext, render_prompt

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


def evaluate_weights(spec: RunSpec, model_dir: Path, weights_dir: Path,
                     rows: list[dict[str, Any]], *, prefix: str = "offline_eval") -> dict[str, float]:
    """Greedy accuracy of ``weights_dir`` (a pushed ``model.safetensors`` on top of the run's
    starting model ``model_dir``). The reward runs in this process: built-in rewards only (user
    code runs in the sandbox, never here)."""
    import torch
    from safetensors.torch import load_file

    from training_core.models.loading import load_model, load_tokenizer

    if not spec.reward.fn.startswith("builtin:"):
        raise ValueError("offline evaluation scores with built-in rewards only; user reward code "
                         "runs in the sandbox")
    reward = resolve_reward(spec.reward.fn, spec.reward.extract)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir).eval()
    model.load_state_dict(load_file(str(Path(weights_dir) / "model.safetensors")), strict=False)
    model.tie_weights()
    scores = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([render_prompt(tokenizer, row, spec.data.prompt_template,
                                              spec.data.chat_template)])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=spec.rollout.max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id)
            completion = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            scores.append(float(reward(completion, row)))
    return {**eval_metrics(scores, prefix), f"{prefix}/rows": float(len(scores))}
