"""What one training step reports: the batch's numbers (rewards, lengths, staleness, failures),
the trainer's (loss, clipping, mismatch, throughput, time) and a few samples for the viewer.
Every name is declared once, in training_core.metric_names."""

from __future__ import annotations

import statistics
from typing import Any

from training_core import metric_names as M
from training_core.algorithms.presets import AlgorithmConfig
from training_core.api import TrainBatch
from training_core.evaluation import CORRECT
from training_core.rollout import Batch
from training_core.workflows.agent import agent_metrics


def batch_metrics(groups, version: int, algo: AlgorithmConfig) -> dict[str, float]:
    samples = [s for g in groups for s in g.samples]
    rewards = [s.reward for s in samples]
    lengths = [s.num_output_tokens for s in samples]
    lags = [version - v for s in samples for v, m in zip(s.versions, s.loss_mask, strict=True) if m]
    return {
        M.REWARD_MEAN: statistics.fmean(rewards),
        M.REWARD_STD: statistics.pstdev(rewards),
        M.REWARD_ACCURACY: sum(r >= CORRECT for r in rewards) / len(rewards),
        M.RESPONSE_LENGTH_MEAN: statistics.fmean(lengths),
        M.RESPONSE_LENGTH_MAX: max(lengths),
        M.STALENESS_MEAN: statistics.fmean(lags) if lags else 0.0,
        M.STALENESS_MAX: max(lags) if lags else 0.0,
        **{name: (sum(1 for x in lags if x == k) / len(lags) if lags else 0.0)
           for k, name in enumerate(M.STALENESS_LAGS)},
        M.INTERRUPTIONS: sum(s.info.get("interruptions", 0) for s in samples),
        M.BUDGET_CLAMPED_FRAC: sum(bool(s.info.get("budget_clamped")) for s in samples) / len(samples),
        M.TRUNCATED_FRAC: sum(s.truncated for s in samples) / len(samples),
        M.REWARD_ERRORS: sum(1 for s in samples if s.info.get("reward_error")),
        M.REWARD_ERROR_FRAC: sum(1 for s in samples if s.info.get("reward_error")) / len(samples),
        **agent_metrics(samples),  # agent/* (turns, segments, forks, tool calls): agent runs only
    }


def advantage_metrics(batch: TrainBatch) -> dict[str, float]:
    """How large the advantages of the tokens that train are (mean and max of |A|)."""
    adv = batch.advantages[batch.loss_mask.bool()].abs()
    if adv.numel() == 0:
        return {M.ADVANTAGE_ABS_MEAN: 0.0, M.ADVANTAGE_ABS_MAX: 0.0}
    return {M.ADVANTAGE_ABS_MEAN: adv.mean().item(), M.ADVANTAGE_ABS_MAX: adv.max().item()}


def sample_records(groups, tokenizer, n: int, extract: str = "auto") -> list[dict[str, Any]]:
    """A few samples per step for the trajectory viewer: text per token and its version."""
    out = []
    for i, s in enumerate(s for g in groups[:n] for s in g.samples[:1]):
        gen = [(t, v) for t, v, m in zip(s.input_ids, s.versions, s.loss_mask, strict=True) if m]
        prompt_ids = [t for t, m in zip(s.input_ids, s.loss_mask, strict=True) if not m]
        out.append({"index": i, "prompt": tokenizer.decode(prompt_ids, skip_special_tokens=True),
                    "completion": s.info.get("completion", ""), "reward": s.reward,
                    "info": {"extracted": s.info.get("extracted"), "extract": extract,
                             "dropped_stale": s.dropped,
                             # agent episodes: the segment turn by turn (gateway/credit.py)
                             **({"turns": s.info["turns_log"]} if "turns_log" in s.info else {})},
                    "tokens": [tokenizer.decode([t]) for t, _ in gen],
                    "token_versions": [v for _, v in gen]})
    return out


def step_metrics(batch: Batch, stats: dict[str, float], *, version: int, running: int,
                 step_time: float) -> dict[str, float]:
    """The trainer's and the rollout side's numbers for one step (the batch's own numbers come
    from :func:`batch_metrics`)."""
    tokens = stats["tokens"]
    per_token = max(tokens, 1.0)
    per_computed = max(stats["computed_tokens"], 1.0)  # the skipped rows have no weights
    return {
        M.LOSS: stats["loss"],
        M.CLIP_FRAC: stats["clipped"] / per_token,
        M.BEHAV_WEIGHT_MEAN: stats["behav_weight_sum"] / per_computed,
        M.BEHAV_WEIGHT_MAX: stats["behav_weight_max"],
        M.BEHAV_WEIGHT_MASKED_FRAC: stats["behav_masked"] / per_computed,
        M.KL: stats["kl_sum"] / per_token,
        M.COMPUTED_ROWS_FRAC: stats["computed_rows_frac"],
        M.GRAD_NORM: stats["grad_norm"],
        M.PROXIMAL_RECOMPUTED_FRAC: stats["proximal_recomputed_frac"],
        M.THREADS_BORROWED: stats["threads_borrowed_phases"],
        M.TOKENS_CONSUMED: tokens,
        M.TOKENS_PER_S: tokens / step_time,
        M.QUEUE_DEPTH: batch.queue_depth,
        M.REJECTED_GROUPS: batch.rejected_groups,
        M.DROPPED_STALE: batch.dropped_stale_samples,
        M.EPISODE_ERRORS: len(batch.episode_failures),
        M.RUNNING: running,
        **{k: v for k, v in stats.items() if k.startswith(("mismatch/", "time/"))},
        M.VERSION: version,
        M.STEP_S: step_time,
        M.GENERATION_WAIT_S: batch.wait_s,
        M.TRAINING_S: step_time - batch.wait_s,
    }
