"""Rollout correction rules and mismatch metrics against hand-computed values.

Two hand-made rows (prox and behav logprobs chosen so the weights w = pi_prox / pi_behav are
round numbers):
    row 0: w = [2, 1, 6]              (three loss tokens)
    row 1: w = [0.25, 1], then a pad  (two loss tokens)
"""

from __future__ import annotations

import math

import pytest
import torch

from training_core.algorithms.correction import (
    CorrectionConfig,
    add_sums,
    apply_correction,
    mismatch_metrics,
    mismatch_sums,
    opsm_mask,
    sequence_mask,
    token_correction,
)
from training_core.algorithms.loss import decoupled_ppo_loss, default_correction
from training_core.algorithms.presets import AlgorithmConfig
from training_core.metric_names import MISMATCH as M

pytestmark = pytest.mark.unit  # no process, network or database (conftest)

LN = math.log


def rows():
    prox = torch.tensor([[0.0, 0.0, 0.0], [LN(0.2), LN(0.5), 0.0]])
    behav = torch.tensor([[LN(0.5), 0.0, LN(1 / 6)], [LN(0.8), LN(0.5), 7.0]])  # pad holds junk
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return prox, behav, mask


def log_w():
    prox, behav, mask = rows()
    return (prox - behav) * mask, mask


def test_truncate_clamps_weights_into_the_bounds():  # TIS
    lw, mask = log_w()
    w, keep, masked, clipped = token_correction(lw, mask, "truncate", 0.5, 5.0)
    assert torch.allclose(w[0], torch.tensor([2.0, 1.0, 5.0]))
    assert torch.allclose(w[1, :2], torch.tensor([0.5, 1.0]))
    assert torch.equal(clipped, torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]))
    assert torch.equal(keep, mask) and masked.sum() == 0


def test_mask_drops_tokens_outside_the_bounds():  # MIS
    lw, mask = log_w()
    w, keep, masked, clipped = token_correction(lw, mask, "mask", 0.5, 5.0)
    assert torch.equal(keep, torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]]))
    assert torch.equal(masked, torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]))
    assert torch.allclose(w[0], torch.tensor([2.0, 1.0, 6.0])) and clipped.sum() == 0
    # The bounds are inclusive: w = 6 with high = 6 stays.
    _, keep, _, _ = token_correction(lw, mask, "mask", 0.25, 6.0)
    assert torch.equal(keep, mask)


def test_geometric_sequence_mask_uses_the_mean_log_ratio():
    lw, mask = log_w()
    # row 0: exp((ln 2 + 0 + ln 6) / 3) = 12^(1/3) = 2.289; row 1: exp(ln 0.25 / 2) = 0.5
    assert torch.equal(sequence_mask(lw, mask, "geometric", 0.4, 2.0), torch.tensor([1.0, 0.0]))
    assert torch.equal(sequence_mask(lw, mask, "geometric", 0.4, 2.3), torch.tensor([0.0, 0.0]))
    assert torch.equal(sequence_mask(lw, mask, "geometric", 0.6, 2.3), torch.tensor([0.0, 1.0]))
    # The plain product: row 0 = 12, row 1 = 0.25
    assert torch.equal(sequence_mask(lw, mask, "product", 0.3, 11.0), torch.tensor([1.0, 1.0]))
    assert torch.equal(sequence_mask(lw, mask, "product", 0.2, 13.0), torch.tensor([0.0, 0.0]))
    assert torch.equal(sequence_mask(lw, mask, "none", 0.9, 1.1), torch.tensor([0.0, 0.0]))


def test_geometric_mean_is_length_invariant_and_the_product_is_not():
    # Ten tokens each with w = 1.1: geometric mean 1.1 (kept under 1.2), product 1.1^10 = 2.59.
    lw = torch.full((1, 10), LN(1.1))
    mask = torch.ones(1, 10)
    assert sequence_mask(lw, mask, "geometric", 1 / 1.2, 1.2).item() == 0.0
    assert sequence_mask(lw, mask, "product", 1 / 1.2, 1.2).item() == 1.0
    # The same per-token mismatch on one token passes both.
    assert sequence_mask(lw[:, :1], mask[:, :1], "product", 1 / 1.2, 1.2).item() == 0.0


def test_opsm_drops_negative_advantage_sequences_far_from_the_policy():
    prox, behav, mask = rows()
    logp = prox  # the current policy
    # mean log(pi_behav / pi_theta): row 0 = (ln 0.5 + 0 + ln 1/6) / 3 = -ln(12)/3 < 0,
    # row 1 = (ln 4 + 0) / 2 = ln 2 = 0.693
    negative = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0]])
    assert torch.equal(opsm_mask(behav, logp, negative, mask, 0.5), torch.tensor([0.0, 1.0]))
    assert torch.equal(opsm_mask(behav, logp, negative, mask, 0.7), torch.tensor([0.0, 0.0]))
    assert torch.equal(opsm_mask(behav, logp, -negative, mask, 0.5), torch.tensor([0.0, 0.0]))
    assert torch.equal(opsm_mask(behav, logp, negative, mask, None), torch.tensor([0.0, 0.0]))


def test_apply_correction_combines_the_rules():
    prox, behav, mask = rows()
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    cfg = CorrectionConfig(token_mode="mask", token_low=0.0, token_high=5.0,
                           sequence_mode="none", opsm_delta=0.5)
    fix = apply_correction(prox, behav, prox, adv, mask, cfg)
    # token 3 of row 0 masked (w = 6 > 5); row 1 dropped whole by OPSM
    assert torch.equal(fix.keep, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(fix.opsm_masked, torch.tensor([0.0, 1.0]))


def test_mismatch_metrics_match_their_formulas():
    prox, behav, mask = rows()
    fix = apply_correction(prox, behav, prox, torch.ones_like(mask), mask,
                           CorrectionConfig(token_mode="truncate", token_low=0.5, token_high=5.0))
    # Split in two micro-batches: the sums must add up to the batch's.
    sums = add_sums(add_sums({}, mismatch_sums(prox[:1], behav[:1], mask[:1])),
                    mismatch_sums(prox[1:], behav[1:], mask[1:]))
    m = mismatch_metrics(sums)
    w = [2.0, 1.0, 6.0, 0.25, 1.0]
    assert m[M.kl_k1] == pytest.approx(-sum(LN(x) for x in w) / 5)  # = -ln(3) / 5
    assert m[M.kl_k3] == pytest.approx(sum(x - 1 - LN(x) for x in w) / 5)
    assert m[M.abs_logp_diff_max] == pytest.approx(LN(6), rel=1e-6)
    assert m[M.weight_mean] == pytest.approx(2.05, rel=1e-6)
    assert m[M.weight_max] == pytest.approx(6.0, rel=1e-6)
    assert m[M.ess] == pytest.approx(10.25 ** 2 / (5 * sum(x * x for x in w)), rel=1e-6)
    # what the truncation did: 2 of 5 tokens clipped, none removed
    fixed = mismatch_metrics(mismatch_sums(prox, behav, mask, fix))
    assert fixed[M.token_clipped_frac] == pytest.approx(2 / 5)
    assert fixed[M.removed_frac] == 0.0 and fixed[M.token_masked_frac] == 0.0


def test_no_mismatch_reads_zero_kl_and_full_ess():
    prox, _, mask = rows()
    m = mismatch_metrics(mismatch_sums(prox, prox.clone(), mask))
    assert m[M.kl_k1] == 0.0 and m[M.kl_k3] == 0.0 and m[M.abs_logp_diff_max] == 0.0
    assert m[M.ess] == pytest.approx(1.0) and m[M.weight_max] == pytest.approx(1.0)


def test_the_default_correction_is_the_presets_behaviour_weight_cap():
    assert default_correction(AlgorithmConfig()) == CorrectionConfig(token_mode="mask",
                                                                     token_high=5.0)
    assert default_correction(AlgorithmConfig(behav_weight_mode="clip",
                                              behav_weight_cap=3.0)).token_mode == "truncate"


def test_loss_drops_a_geometric_outlier_sequence_and_reports_it():
    prox, behav, mask = rows()
    logp = prox.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    cfg = AlgorithmConfig(eps_clip_low=0.2, eps_clip_high=0.2)
    corr = CorrectionConfig(token_mode="none", sequence_mode="geometric", sequence_low=0.4,
                            sequence_high=2.0)
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, cfg=cfg, num_tokens=5,
                                     correction=corr)
    # r = 1 everywhere; row 0 masked (geometric mean 2.29 > 2); row 1: w = [0.25, 1], A = 1
    assert loss.item() == pytest.approx(-(0.25 + 1.0) / 5, abs=1e-6)
    assert stats.behav_masked == 3 and stats.tokens == 5
    assert mismatch_metrics(stats.mismatch)[M.seq_masked_frac] == pytest.approx(0.5)
