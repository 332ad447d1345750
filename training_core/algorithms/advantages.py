"""Outcome-reward advantages: one scalar per sample, broadcast over its output tokens."""

from __future__ import annotations

import torch

from training_core.algorithms.presets import AlgorithmConfig


def group_advantages(
    rewards: torch.Tensor, cfg: AlgorithmConfig, eps: float = 1e-6
) -> torch.Tensor:
    """``rewards`` is [groups, n]; returns advantages of the same shape.

    group_mean:     A = r - mean(group)            (/ std(group) when normalize_std)
    leave_one_out:  A = r - mean(other samples)    (RLOO; n must be >= 2)
    batch_mean:     A = r - mean(batch)            (/ std(batch) when normalize_std)

    The std is the sample std (Bessel, divides by n - 1) by default, as verl, AReaL and TRL
    compute it; ``cfg.std_estimator = "population"`` divides by n instead (Oolong's convention
    before issue 48). With rewards 1, 0, 0, 1 the sample std is 0.577, the population std 0.5.
    """
    if rewards.dim() != 2:
        raise ValueError("rewards must be [groups, group_size]")
    rewards = rewards.to(torch.float32)
    n = rewards.shape[1]
    unbiased = cfg.std_estimator == "sample"
    if cfg.baseline == "group_mean":
        adv = rewards - rewards.mean(dim=1, keepdim=True)
        scale = rewards.std(dim=1, keepdim=True, unbiased=unbiased) if n > 1 else None
    elif cfg.baseline == "leave_one_out":
        if n < 2:
            raise ValueError("leave_one_out needs group_size >= 2")
        others = (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)
        adv = rewards - others
        scale = rewards.std(dim=1, keepdim=True, unbiased=unbiased)
    elif cfg.baseline == "batch_mean":
        adv = rewards - rewards.mean()
        scale = rewards.std(unbiased=unbiased).expand_as(rewards) if rewards.numel() > 1 else None
    else:  # pragma: no cover - guarded by the Literal in AlgorithmConfig
        raise ValueError(f"unknown baseline {cfg.baseline!r}")
    if cfg.normalize_std and scale is not None:
        adv = adv / (scale + eps)
    return adv


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, cfg: AlgorithmConfig) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to ``max - buffer`` tokens, then a linear ramp to
    ``-overlong_penalty`` at ``max`` tokens; ``buffer`` is ``overlong_buffer`` (a fraction) of
    ``max_new_tokens``, at least one token."""
    if cfg.overlong_buffer <= 0 or cfg.overlong_penalty == 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    buffer = max(1, round(cfg.overlong_buffer * max_new_tokens))
    start = max_new_tokens - buffer
    over = (lengths.to(torch.float32) - start).clamp(min=0) / buffer
    return -cfg.overlong_penalty * over.clamp(max=1.0)


def is_degenerate_group(rewards: list[float], tol: float = 1e-9) -> bool:
    """DAPO dynamic filtering: a group whose rewards are all equal carries no gradient."""
    return max(rewards) - min(rewards) <= tol
