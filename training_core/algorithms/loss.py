"""The decoupled PPO objective, as a pure tensor function.

For output token t with advantage A_t:
    r_t = exp(logp_theta - logp_prox)     proximal policy: the policy before this update
    w_t = exp(logp_prox - logp_behav)     behaviour policy: the rollout server's logprobs
    l_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
The rollout correction (algorithms/correction.py) decides w_t and which tokens and sequences
stay: by default w_t above ``behav_weight_cap`` is masked (its token dropped) or clipped to the
cap (``behav_weight_mode``), as before the correction block existed. The loss is
sum(l_t) / num_tokens, where ``num_tokens`` is the output-token count of the *global* batch so
micro-batches add up to a token mean over the whole batch (every preset; see presets.py).

Masked positions are selected away (``torch.where``, correction.masked) *before* ``exp`` and
before the sum, never multiplied by 0: a padded or prompt position can hold any logprob, -inf
included, and exp(gap) = inf (or -inf itself) times a mask of 0 is NaN.

The clip fraction counts the tokens the loss keeps: a token the rollout correction removed
contributes nothing, so it is not counted as clipped either.

KL penalty (``kl_coef > 0``): k2 = (logp_theta - logp_ref)^2 / 2 is added per token to the loss.
Its gradient, (logp_theta - logp_ref) * grad logp_theta, is in expectation over on-policy samples
the gradient of KL(pi_theta || pi_ref); the k3 estimator in the loss is unbiased for the KL
*value* but not for its gradient. The ``kl`` metric reports k3, the non-negative unbiased value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from training_core.algorithms.correction import (
    CorrectionConfig,
    apply_correction,
    masked,
    mismatch_sums,
)
from training_core.algorithms.presets import AlgorithmConfig


@dataclass
class LossStats:
    """Sums over the micro-batch; divide by ``tokens`` for means."""

    tokens: float
    clipped: float
    behav_weight_sum: float
    behav_weight_max: float
    behav_masked: float
    kl_sum: float
    # Additive behaviour-proximal statistics (correction.mismatch_sums); empty if not decoupled.
    mismatch: dict[str, float] = field(default_factory=dict)


def resolve_correction(block: Any, cfg: AlgorithmConfig) -> CorrectionConfig:
    """``algorithm.rollout_correction`` (config.RolloutCorrectionSpec or None) with its unset
    token fields taken from the preset's behaviour-weight cap."""
    base = default_correction(cfg)
    if block is None:
        return base
    high = block.token_high if block.token_high is not None else base.token_high
    seq_low = block.sequence_low if block.sequence_low is not None else 1.0 / block.sequence_high
    return CorrectionConfig(token_mode=block.token_mode or base.token_mode,
                            token_low=block.token_low, token_high=high,
                            sequence_mode=block.sequence_mode, sequence_low=seq_low,
                            sequence_high=block.sequence_high, opsm_delta=block.opsm_delta)


def default_correction(cfg: AlgorithmConfig) -> CorrectionConfig:
    """The preset's behaviour-weight cap as a correction: mask (MIS) or truncate (TIS) above it."""
    return CorrectionConfig(token_mode="mask" if cfg.behav_weight_mode == "mask" else "truncate",
                            token_high=cfg.behav_weight_cap)


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cfg: AlgorithmConfig,
    num_tokens: float,
    ref_logp: torch.Tensor | None = None,
    correction: CorrectionConfig | None = None,
) -> tuple[torch.Tensor, LossStats]:
    mask = mask.to(logp.dtype)
    ratio = torch.exp(masked(logp - prox_logp, mask))
    clipped_ratio = ratio.clamp(1.0 - cfg.eps_clip_low, 1.0 + cfg.eps_clip_high)
    surr1 = -advantages * ratio
    surr2 = -advantages * clipped_ratio
    per_token = torch.maximum(surr1, surr2)

    generated = mask  # the token count of the stats: before the correction masks any
    mismatch: dict[str, float] = {}
    if cfg.decoupled:
        with torch.no_grad():
            fix = apply_correction(prox_logp, behav_logp, logp, advantages, mask,
                                   correction or default_correction(cfg))
            mismatch = mismatch_sums(prox_logp, behav_logp, generated, fix)
            over = generated - fix.keep  # every token a rule removed
            mask, w = fix.keep, fix.weights
        per_token = per_token * w
    else:
        w = torch.ones_like(logp)
        over = torch.zeros_like(logp)
        # Plain PPO's old policy is the behaviour policy; the trainer's own forward (before the
        # step, on the first minibatch) still shows how far the servers are from the trainer.
        mismatch = mismatch_sums(logp.detach(), behav_logp, mask)

    kl_sum = 0.0
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        log_ratio = masked(logp - ref_logp, mask)
        per_token = per_token + cfg.kl_coef * 0.5 * log_ratio.square()  # k2: see the module doc
        with torch.no_grad():
            k3 = torch.exp(-log_ratio) + log_ratio - 1.0
        kl_sum = float(masked(k3, mask).sum())

    loss = masked(per_token, mask).sum() / max(num_tokens, 1.0)
    wm = masked(w.detach(), mask)
    # After the correction: ``mask`` is what the loss keeps.
    clipped = masked((surr2 > surr1).to(logp.dtype), mask)
    stats = LossStats(
        tokens=float(generated.sum()),
        clipped=float(clipped.sum()),
        behav_weight_sum=float(wm.sum()),
        behav_weight_max=float(wm.max()) if wm.numel() else 0.0,
        behav_masked=float(over.sum()),
        kl_sum=kl_sum,
        mismatch=mismatch,
    )
    return loss, stats
