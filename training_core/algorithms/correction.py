"""Rollout correction and rollout-training mismatch metrics, as pure tensor functions.

The rollout servers sample from the *behaviour* policy pi_behav (their logprobs travel with each
token); the update's trust region is around the *proximal* policy pi_prox (the trainer's policy
before the update). The two differ when the data are stale and whenever the servers do not
compute the trainer's distribution exactly (bf16 engine against a fp32 trainer, other kernels).
Per output token the importance weight is

    w_t = pi_prox(y_t) / pi_behav(y_t) = exp(logp_prox - logp_behav)

and the corrections below decide which tokens and sequences the loss keeps and with what weight
(in the spirit of verl's ``rollout_correction`` and AReaL's ``rejection_sampling``):

- token level, ``truncate`` (TIS): w_t <- clamp(w_t, low, high);
- token level, ``mask`` (MIS): a token with w_t outside [low, high] leaves the loss;
- sequence level, ``geometric``: a sequence whose geometric mean ratio
  exp(mean_t log w_t) is outside [low, high] leaves the loss. Length-invariant, unlike the plain
  product of the ratios (``product``: exp(sum_t log w_t)), whose spread grows with the length and
  so masks long answers far more often; ``product`` exists for comparison, never by default;
- OPSM (off-policy sequence masking, DeepSeek-V3.2): a sequence with a negative advantage whose
  mean log-ratio log(pi_behav / pi_theta) exceeds delta leaves the loss. Negative-advantage
  samples far from the current policy give the largest destabilising pushes.

Masked positions are *selected* away (``torch.where``), never multiplied by 0: a prompt or pad
position can hold any logprob, -inf included, and -inf times 0 is NaN. Log-ratios are then
clamped to +-20 before ``exp`` (e^20 ~ 5e8): a diverged loss token can hold any gap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from training_core.metric_names import MISMATCH as M

LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class CorrectionConfig:
    """A resolved ``algorithm.rollout_correction`` block (config.RolloutCorrectionSpec).
    The default is the behaviour-weight cap the presets always had: mask tokens with w > 5."""

    token_mode: Literal["truncate", "mask", "none"] = "mask"
    token_low: float = 0.0  # 0: no lower bound
    token_high: float = 5.0
    sequence_mode: Literal["none", "geometric", "product"] = "none"
    sequence_low: float = 1.0 / 1.05
    sequence_high: float = 1.05
    opsm_delta: float | None = None  # None: OPSM off


@dataclass
class Correction:
    """What the correction decided for a micro-batch: the per-token weights the loss multiplies
    by, the mask of kept tokens, and what each rule removed (float tensors, same shape)."""

    weights: torch.Tensor
    keep: torch.Tensor
    token_masked: torch.Tensor  # tokens a token-level mask removed
    token_clipped: torch.Tensor  # tokens whose weight TIS truncated
    seq_masked: torch.Tensor  # per row (shape [rows]): the sequence rule removed it
    opsm_masked: torch.Tensor  # per row: OPSM removed it


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` on loss tokens, 0 elsewhere, by selection: whatever a masked position holds
    (inf, NaN) never reaches the result, nor, through ``where``'s backward, the gradient."""
    return torch.where(mask.bool(), values, torch.zeros_like(values))


def log_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
    """log w_t = logp_prox - logp_behav on loss tokens, 0 elsewhere, clamped to +-20."""
    return masked(prox_logp - behav_logp, mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def token_correction(log_w: torch.Tensor, mask: torch.Tensor, mode: str, low: float,
                     high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token level: (weights, kept mask, masked, clipped). ``truncate`` clamps w into
    [low, high] (TIS); ``mask`` drops tokens whose w is outside it (MIS); ``none`` keeps w."""
    w = torch.exp(log_w)
    zero = torch.zeros_like(mask)
    if mode == "truncate":
        clamped = w.clamp(min=low, max=high)
        return clamped, mask, zero, (clamped != w).to(mask.dtype) * mask
    if mode == "mask":
        outside = ((w < low) | (w > high)).to(mask.dtype) * mask
        return w, mask * (1.0 - outside), outside, zero
    if mode == "none":
        return w, mask, zero, zero
    raise ValueError(f"token mode {mode!r}: use truncate, mask or none")


def sequence_log_ratio(log_w: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Per row: the mean (``geometric``) or the sum (``product``) of the token log-ratios over
    its loss tokens; a row without loss tokens gets 0 (ratio 1)."""
    total = (log_w * mask).sum(dim=1)
    if mode == "product":
        return total
    if mode == "geometric":
        return total / mask.sum(dim=1).clamp(min=1.0)
    raise ValueError(f"sequence mode {mode!r}: use geometric or product")


def sequence_mask(log_w: torch.Tensor, mask: torch.Tensor, mode: str, low: float,
                  high: float) -> torch.Tensor:
    """Per row, 1.0 where the sequence is masked: its geometric-mean (or product) ratio is
    outside [low, high]. ``none`` masks nothing. Compared in log space (no overflow)."""
    if mode == "none":
        return torch.zeros(mask.shape[0], dtype=mask.dtype, device=mask.device)
    seq = sequence_log_ratio(log_w, mask, mode)
    lo = torch.log(torch.tensor(low, dtype=seq.dtype)) if low > 0 else torch.tensor(-torch.inf)
    hi = torch.log(torch.tensor(high, dtype=seq.dtype))
    return ((seq < lo.to(seq.device)) | (seq > hi.to(seq.device))).to(mask.dtype)


def opsm_mask(behav_logp: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, delta: float | None) -> torch.Tensor:
    """Per row, 1.0 where OPSM drops the sequence: its advantage is negative and the mean over
    its loss tokens of log(pi_behav / pi_theta) exceeds ``delta``. ``logp`` is the current
    policy's (no gradient flows through the decision). None: nothing is dropped."""
    rows = torch.zeros(mask.shape[0], dtype=mask.dtype, device=mask.device)
    if delta is None:
        return rows
    n = mask.sum(dim=1).clamp(min=1.0)
    mean_lr = masked(behav_logp - logp.detach(), mask).sum(dim=1) / n
    negative = (advantages * mask).sum(dim=1) < 0
    return (negative & (mean_lr > delta) & (mask.sum(dim=1) > 0)).to(mask.dtype)


def apply_correction(prox_logp: torch.Tensor, behav_logp: torch.Tensor, logp: torch.Tensor,
                     advantages: torch.Tensor, mask: torch.Tensor,
                     cfg: CorrectionConfig) -> Correction:
    """Every rule of ``cfg`` on one micro-batch (rows are whole samples)."""
    log_w = log_weights(prox_logp, behav_logp, mask)
    w, keep, masked, clipped = token_correction(log_w, mask, cfg.token_mode, cfg.token_low,
                                                cfg.token_high)
    seq = sequence_mask(log_w, mask, cfg.sequence_mode, cfg.sequence_low, cfg.sequence_high)
    opsm = opsm_mask(behav_logp, logp, advantages, mask, cfg.opsm_delta)
    keep = keep * (1.0 - seq).unsqueeze(1) * (1.0 - opsm).unsqueeze(1)
    return Correction(w, keep, masked, clipped, seq, opsm)


# ---- mismatch metrics ---------------------------------------------------------------------------

# Sums over micro-batches (and ranks) add; "max" entries take the maximum.
MISMATCH_MAX_KEYS = ("mm_abs_logp_diff_max", "mm_weight_max")
MISMATCH_SUM_KEYS = ("mm_tokens", "mm_k1_sum", "mm_k3_sum", "mm_weight_sum", "mm_weight_sq_sum",
                     "mm_rows", "mm_token_masked", "mm_token_clipped", "mm_removed",
                     "mm_seq_masked", "mm_opsm_masked")


def mismatch_sums(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
                  correction: Correction | None = None) -> dict[str, float]:
    """Additive statistics of the behaviour-proximal mismatch on the loss tokens, before any
    correction; :func:`mismatch_metrics` turns them into the per-step metrics.

    KL(behav || prox) from samples of the behaviour policy, with log r = logp_prox - logp_behav:
    k1 = -log r (unbiased, can be negative on a batch), k3 = r - 1 - log r (unbiased, >= 0)."""
    with torch.no_grad():
        m = mask.to(torch.float64)
        diff = masked(prox_logp.to(torch.float64) - behav_logp.to(torch.float64), m)
        log_r = diff.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        r = torch.exp(log_r) * m
        any_token = bool(m.sum() > 0)
        out = {
            "mm_tokens": float(m.sum()),
            "mm_k1_sum": float((-log_r * m).sum()),
            "mm_k3_sum": float(((r - 1.0 - log_r) * m).sum()),
            "mm_abs_logp_diff_max": float(diff.abs().max()) if any_token else 0.0,
            "mm_weight_sum": float(r.sum()),
            "mm_weight_sq_sum": float((r * r).sum()),
            "mm_weight_max": float(r.max()) if any_token else 0.0,
            "mm_rows": float((m.sum(dim=1) > 0).sum()),
        }
        if correction is not None:
            out.update({
                "mm_token_masked": float(correction.token_masked.sum()),
                "mm_token_clipped": float(correction.token_clipped.sum()),
                "mm_removed": float((m - correction.keep.to(torch.float64) * m).sum()),
                "mm_seq_masked": float(correction.seq_masked.sum()),
                "mm_opsm_masked": float(correction.opsm_masked.sum()),
            })
        return out


def add_sums(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    """Fold one micro-batch's :func:`mismatch_sums` into ``total`` (in place, returned)."""
    for key, value in part.items():
        if key in MISMATCH_MAX_KEYS:
            total[key] = max(total.get(key, 0.0), value)
        else:
            total[key] = total.get(key, 0.0) + value
    return total


def mismatch_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The per-step metrics (names in training_core/metrics.py) from summed statistics.
    ESS is normalised: (sum w)^2 / (n sum w^2), 1 when every weight is equal."""
    n = sums.get("mm_tokens", 0.0)
    if n <= 0:
        return {}
    rows = max(sums.get("mm_rows", 0.0), 1.0)
    sq = sums["mm_weight_sq_sum"]
    return {
        M.kl_k1: sums["mm_k1_sum"] / n,
        M.kl_k3: sums["mm_k3_sum"] / n,
        M.abs_logp_diff_max: sums["mm_abs_logp_diff_max"],
        M.weight_mean: sums["mm_weight_sum"] / n,
        M.weight_max: sums["mm_weight_max"],
        M.ess: (sums["mm_weight_sum"] ** 2) / (n * sq) if sq > 0 else 1.0,
        M.token_masked_frac: sums.get("mm_token_masked", 0.0) / n,
        M.token_clipped_frac: sums.get("mm_token_clipped", 0.0) / n,
        M.removed_frac: sums.get("mm_removed", 0.0) / n,
        M.seq_masked_frac: sums.get("mm_seq_masked", 0.0) / rows,
        M.opsm_masked_frac: sums.get("mm_opsm_masked", 0.0) / rows,
    }
