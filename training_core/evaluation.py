"""Evaluation: greedy accuracy, avg@k, pass@k and maj@k with 95% intervals on held-out sets.

Two ways to generate, one way to prompt and to score: prompts are rendered like training's
(``render_prompt``: the template and the chat template), completions are scored by the run's
reward with its answer extraction, and both report :func:`eval_metrics` and
:func:`training_core.eval_stats.set_statistics`.

- :func:`evaluate_sets` generates through the rollout servers, beside training (train.py): per
  eval set, a greedy completion and ``eval.samples`` sampled ones per question, reported as
  ``eval/<set>/<metric>`` (training_core/eval_stats.py says how each is computed) with the weight
  version they were taken at; the run's own set also keeps the older ``eval/accuracy`` keys.
  :func:`evaluate` is its greedy part alone.
- ``offline_eval.evaluate_weights`` loads a run's pushed weights into an embedded engine in this
  process and generates every row at once: the offline evaluation job (a Celery worker runs it
  for the web app). ``offline_eval.evaluate_version`` does the same with every statistic of
  :func:`evaluate_sets`: ``oolong eval`` (eval_cli.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import Any

from training_core.api import EpisodeError, GenerationRequest, InferenceEngine, SamplingParams
from training_core.eval_stats import set_statistics
from training_core.metric_names import EVAL_ERRORS, eval_set_metric
from training_core.workflows.base import WorkflowContext

CORRECT = 1.0 - 1e-6  # a reward this high counts as a correct answer

log = logging.getLogger(__name__)


def eval_metrics(rewards: list[float], prefix: str = "eval") -> dict[str, float]:
    if not rewards:
        return {}
    return {f"{prefix}/accuracy": sum(r >= CORRECT for r in rewards) / len(rewards),
            f"{prefix}/reward": sum(rewards) / len(rewards)}


@dataclass
class RowResult:
    """One eval question: its greedy reward, and per sampled completion the reward and the
    answer the reward extracted (None: none found, or a reward that does not say)."""

    greedy: float
    samples: list[float]
    answers: list[str | None]


async def _score_rows(client: InferenceEngine, ctx: WorkflowContext, rows: list[dict[str, Any]],
                      max_new_tokens: int, samples: int, failed: list[str]) -> list[RowResult]:
    """Greedy and ``samples`` sampled completions per row, scored. A failed episode scores 0 and
    its message goes to ``failed``. Agent workflows (``ctx.evaluate_episode``) evaluate their own
    greedy episode and draw no samples."""
    greedy = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    sampled = replace(ctx.sampling, max_new_tokens=max_new_tokens, greedy=False) \
        if samples else greedy

    async def one(item: dict[str, Any], params: SamplingParams) -> tuple[float, str | None]:
        try:
            if ctx.evaluate_episode is not None:  # an agent: its own greedy episode
                return float(await ctx.evaluate_episode(client, item)), None
            resp = await client.agenerate(GenerationRequest(ctx.render_prompt(item), params))
            text = ctx.decode(resp.output_ids)
            scored = await ctx.rewards.score(text, item)
            answer = scored.extracted
            if answer is None and not str(getattr(ctx.rewards, "fn_path", "")).startswith(
                    "builtin:"):  # a function reward extracts nothing: vote on the whole text
                answer = " ".join(text.split()) or None
            return scored.reward, answer
        except EpisodeError as exc:  # this row's fault; a server down still fails the run
            failed.append(f"{type(exc).__name__}: {exc}")
            return 0.0, None

    async def row(item: dict[str, Any]) -> RowResult:
        n = 0 if ctx.evaluate_episode is not None else samples
        got = await asyncio.gather(one(item, greedy), *[one(item, sampled) for _ in range(n)])
        return RowResult(got[0][0], [r for r, _ in got[1:]], [a for _, a in got[1:]])

    return list(await asyncio.gather(*[row(r) for r in rows]))


def _log_failures(failed: list[str], rows: int, errors: list[str] | None) -> None:
    if failed:
        log.warning("evaluation: %d of %d completions failed (scored 0); first: %s", len(failed),
                    rows, failed[0])
        if errors is not None:
            errors.extend(failed)


async def evaluate(client: InferenceEngine, ctx: WorkflowContext, rows: list[dict[str, Any]],
                   max_new_tokens: int, errors: list[str] | None = None) -> dict[str, float]:
    """Greedy accuracy on held-out rows, through the same servers (runs beside training).

    A row whose episode fails (a prompt too long for the server, a request it rejects) scores 0
    and is counted in ``eval/errors``: one bad eval row must not fail the run. Servers that stay
    unreachable (``RolloutServerError``) still fail it. Accuracy keeps every row in its
    denominator, so evaluations stay comparable. The failed rows' messages are appended to
    ``errors`` when it is given."""
    failed: list[str] = []
    results = await _score_rows(client, ctx, rows, max_new_tokens, 0, failed)
    _log_failures(failed, len(rows), errors)
    out = eval_metrics([r.greedy for r in results])
    return {**out, EVAL_ERRORS: float(len(failed))} if out else out


async def evaluate_sets(client: InferenceEngine, ctx: WorkflowContext,
                        sets: dict[str, list[dict[str, Any]]], *, max_new_tokens: int,
                        version: int, samples: int = 0, k: int | None = None,
                        overlap: dict[str, float] | None = None,
                        seen: dict[str, float] | None = None,
                        errors: list[str] | None = None) -> dict[str, float]:
    """Every eval set at one weight version: ``eval/<set>/...`` (greedy accuracy; with
    ``samples`` > 0 also avg@k, pass@k and maj@k; each with its 95% interval; the version; the
    measured ``overlap_train_pool`` when ``overlap`` gives it, and ``seen_in_trained_batch``,
    the fraction of its questions some training batch held so far, when ``seen`` does). The
    first set also reports the older ``eval/accuracy``, ``eval/reward`` and ``eval/errors``
    (charts and the CLI read them).
    Failures score 0 and are counted, as in :func:`evaluate`."""
    out: dict[str, float] = {}
    for i, (name, rows) in enumerate(sets.items()):
        if not rows:
            continue
        failed: list[str] = []
        results = await _score_rows(client, ctx, rows, max_new_tokens, samples, failed)
        _log_failures(failed, len(rows), errors)
        stats = set_statistics(
            [r.greedy >= CORRECT for r in results],
            [[x >= CORRECT for x in r.samples] for r in results] if samples and results[0].samples
            else None,
            [r.answers for r in results], k)
        stats.update({"version": float(version), "errors": float(len(failed))})
        if overlap is not None and name in overlap:
            stats["overlap_train_pool"] = overlap[name]
        if seen is not None and name in seen:
            stats["seen_in_trained_batch"] = seen[name]
        out.update({eval_set_metric(name, key): value for key, value in stats.items()})
        if i == 0:
            out.update({**eval_metrics([r.greedy for r in results]),
                        EVAL_ERRORS: float(len(failed))})
    return out
