"""The decoupled PPO objective, as a pure tensor function.

For output token t with advantage A_t:
    r_t = exp(logp_theta - logp_prox)     proximal policy: the policy before this update
    w_t = exp(logp_prox - logp_behav)     behaviour policy: the rollout server's logprobs
    l_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
w_t above ``cap`` is masked (its token dropped) or clipped to the cap. The loss is
sum(l_t) / num_tokens, where ``num_tokens`` is the output-token count of the *global* batch so
micro-batches add up to a token mean over the whole batch (every preset; see presets.py).

Log-ratios are multiplied by the mask *before* ``exp``: a padded or prompt position can hold any
logit gap, and exp(gap) = inf times a mask of 0 is NaN.

KL penalty (``kl_coef > 0``): k2 = (logp_theta - logp_ref)^2 / 2 is added per token to the loss.
Its gradient, (logp_theta - logp_ref) * grad logp_theta, is in expectation over on-policy samples
the gradient of KL(pi_theta || pi_ref); the k3 estimator in the loss is unbiased for the KL
*value* but not for its gradient. The ``kl`` metric reports k3, the non-negative unbiased value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
) -> tuple[torch.Tensor, LossStats]:
    mask = mask.to(logp.dtype)
    ratio = torch.exp((logp - prox_logp) * mask)
    clipped_ratio = ratio.clamp(1.0 - cfg.eps_clip_low, 1.0 + cfg.eps_clip_high)
    surr1 = -advantages * ratio
    surr2 = -advantages * clipped_ratio
    per_token = torch.maximum(surr1, surr2)
    clipped = (surr2 > surr1).to(logp.dtype) * mask

    generated = mask  # the token count of the stats: before the behaviour cap masks any
    if cfg.decoupled:
        with torch.no_grad():
            w = torch.exp((prox_logp - behav_logp) * mask)
            over = (w > cfg.behav_weight_cap).to(logp.dtype) * mask
            if cfg.behav_weight_mode == "mask":
                mask = mask * (1.0 - over)
            else:
                w = w.clamp(max=cfg.behav_weight_cap)
        per_token = per_token * w
    else:
        w = torch.ones_like(logp)
        over = torch.zeros_like(logp)

    kl_sum = 0.0
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        log_ratio = (logp - ref_logp) * mask
        per_token = per_token + cfg.kl_coef * 0.5 * log_ratio.square()  # k2: see the module doc
        with torch.no_grad():
            k3 = torch.exp(-log_ratio) + log_ratio - 1.0
        kl_sum = float((k3 * mask).sum())

    loss = (per_token * mask).sum() / max(num_tokens, 1.0)
    wm = w.detach() * mask
    stats = LossStats(
        tokens=float(generated.sum()),
        clipped=float(clipped.sum()),
        behav_weight_sum=float(wm.sum()),
        behav_weight_max=float(wm.max()) if wm.numel() else 0.0,
        behav_masked=float(over.sum()),
        kl_sum=kl_sum,
    )
    return loss, stats
