"""Advantages and the decoupled PPO loss against hand-computed values."""

import math

import pytest
import torch

from training_core.algorithms.advantages import (
    group_advantages,
    is_degenerate_group,
    overlong_penalty,
)
from training_core.algorithms.loss import decoupled_ppo_loss
from training_core.algorithms.presets import PRESETS, AlgorithmConfig, resolve_algorithm

pytestmark = pytest.mark.unit  # no process, network or database (conftest)


def test_grpo_normalises_by_group_mean_and_sample_std():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), PRESETS["grpo"])
    # mean 0.5; the sample std (n - 1, as verl, AReaL and TRL) is sqrt(1/3) = 0.577
    expected = 0.5 / math.sqrt(1 / 3)
    assert torch.allclose(adv, torch.tensor([[expected, -expected, -expected, expected]]),
                          atol=1e-4)


def test_population_std_is_an_option():
    cfg = resolve_algorithm("grpo", std_estimator="population")
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), cfg)
    # mean 0.5, population std 0.5
    assert torch.allclose(adv, torch.tensor([[1.0, -1.0, -1.0, 1.0]]), atol=1e-4)
    batch = group_advantages(torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
                             AlgorithmConfig(baseline="batch_mean", std_estimator="population"))
    assert torch.allclose(batch, torch.tensor([[1.0, -1.0], [-1.0, 1.0]]), atol=1e-4)


def test_a_group_of_one_keeps_a_finite_advantage():
    # The sample std of one value is NaN: a group of one is left unscaled, not NaN.
    adv = group_advantages(torch.tensor([[1.0], [0.0]]), PRESETS["grpo"])
    assert torch.isfinite(adv).all()


def test_dr_grpo_has_no_std():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), PRESETS["dr_grpo"])
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5]]))


def test_rloo_leave_one_out():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0]]), PRESETS["rloo"])
    # sample 0: 1 - mean(0, 0) = 1; samples 1, 2: 0 - mean(1, 0) = -0.5
    assert torch.allclose(adv, torch.tensor([[1.0, -0.5, -0.5]]))


def test_groups_are_independent():
    adv = group_advantages(torch.tensor([[1.0, 0.0], [5.0, 5.0]]), PRESETS["dr_grpo"])
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5], [0.0, 0.0]]))


def test_batch_mean_baseline_for_ppo_kl():
    adv = group_advantages(torch.tensor([[1.0, 0.0], [1.0, 2.0]]), PRESETS["ppo_kl"])
    assert torch.allclose(adv, torch.tensor([[0.0, -1.0], [0.0, 1.0]]))


def test_overlong_penalty_ramp():
    cfg = AlgorithmConfig(overlong_buffer=0.4, overlong_penalty=1.0)  # 4 of 10 tokens
    pen = overlong_penalty(torch.tensor([6, 8, 10]), 10, cfg)
    assert torch.allclose(pen, torch.tensor([0.0, -0.5, -1.0]))
    # The window scales with the budget: the same fraction of 100 tokens is 40 tokens.
    pen = overlong_penalty(torch.tensor([60, 80, 100]), 100, cfg)
    assert torch.allclose(pen, torch.tensor([0.0, -0.5, -1.0]))
    assert overlong_penalty(torch.tensor([10]), 10, PRESETS["grpo"]).item() == 0.0


def test_dynamic_filter_detects_all_equal_groups():
    assert is_degenerate_group([1.0, 1.0, 1.0])
    assert not is_degenerate_group([1.0, 0.0, 1.0])


def test_presets_are_data_and_overridable():
    dapo = resolve_algorithm("dapo", eps_clip_high=0.3, kl_coef=None)
    assert dapo.eps_clip_high == 0.3 and dapo.dynamic_filter and dapo.eps_clip_low == 0.2
    with pytest.raises(ValueError, match="unknown algorithm preset"):
        resolve_algorithm("nope")


def _three_tokens():
    # token 1: r = 1.3, A = 1   -> clipped at 1.2, w = exp(0 - log 0.5) = 2  -> l = 2 * -1.2 = -2.4
    # token 2: r = 0.7, A = -1  -> clipped at 0.8, w = 1                     -> l = 0.8
    # token 3: r = 1.1, A = 2   -> unclipped -2.2, w = 6 > cap 5              -> masked (or w = 5)
    logp = torch.tensor([[math.log(1.3), math.log(0.7), math.log(1.1)]], requires_grad=True)
    prox = torch.zeros(1, 3)
    behav = torch.tensor([[math.log(0.5), 0.0, math.log(1 / 6)]])
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    return logp, prox, behav, adv, mask


def test_decoupled_loss_masks_large_behaviour_weights():
    logp, prox, behav, adv, mask = _three_tokens()
    cfg = AlgorithmConfig(behav_weight_mode="mask")
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, cfg=cfg, num_tokens=3)
    assert loss.item() == pytest.approx((-2.4 + 0.8) / 3, abs=1e-5)
    # Token counts are taken before the cap masks token 3: clip and masked fractions share
    # one denominator, the generated tokens.
    assert stats.clipped == 2 and stats.behav_masked == 1 and stats.tokens == 3
    loss.backward()
    # tokens 1 and 2 are clipped (no gradient), token 3 is masked
    assert torch.allclose(logp.grad, torch.zeros(1, 3))


def test_decoupled_loss_clips_large_behaviour_weights():
    logp, prox, behav, adv, mask = _three_tokens()
    cfg = AlgorithmConfig(behav_weight_mode="clip")
    loss, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, cfg=cfg, num_tokens=3)
    assert loss.item() == pytest.approx((-2.4 + 0.8 + 5 * -2.2) / 3, abs=1e-5)
    loss.backward()
    # d/dlogp of w * -A * exp(logp - prox) = -w * A * r, divided by the token count
    assert logp.grad[0, 2].item() == pytest.approx(-5 * 2 * 1.1 / 3, abs=1e-5)


def test_non_decoupled_loss_is_plain_ppo():
    logp, prox, behav, adv, mask = _three_tokens()
    cfg = AlgorithmConfig(decoupled=False)
    loss, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, cfg=cfg, num_tokens=3)
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.2) / 3, abs=1e-5)


def test_token_mean_uses_the_global_token_count():
    logp, prox, behav, adv, mask = _three_tokens()
    cfg = AlgorithmConfig(decoupled=False)
    half, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, cfg=cfg, num_tokens=6)
    full, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, cfg=cfg, num_tokens=3)
    assert half.item() == pytest.approx(full.item() / 2)


def test_kl_penalty_is_k2_in_the_loss_and_k3_in_the_metric():
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]])
    zero = torch.zeros(1, 1)
    cfg = AlgorithmConfig(decoupled=False, kl_coef=2.0)
    loss, stats = decoupled_ppo_loss(logp, logp.detach().clone(), logp.detach().clone(), zero,
                                     torch.ones(1, 1), cfg=cfg, num_tokens=1, ref_logp=ref)
    # k2 = (logp - ref)^2 / 2 = (ln 2)^2 / 2, times kl_coef
    assert loss.item() == pytest.approx(2.0 * math.log(2) ** 2 / 2, abs=1e-6)
    # Its gradient is kl_coef * (logp - ref): the on-policy gradient of KL(pi || ref).
    loss.backward()
    assert logp.grad.item() == pytest.approx(2.0 * math.log(2), abs=1e-6)
    # The reported KL is k3 = exp(ref - logp) - (ref - logp) - 1 = 0.5 + ln 2 - 1
    assert stats.kl_sum == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)


def test_clip_fraction_skips_tokens_the_correction_removed():
    # token 1 is clipped (r = 1.3 > 1.2, A = 1) and kept (w = 2); token 2 is clipped too
    # (r = 1.3, A = 1) but its behaviour weight w = 6 passes the cap of 5: the correction
    # removes it from the loss, so it is not counted as clipped either.
    logp = torch.tensor([[math.log(1.3), math.log(1.3)]])
    prox = torch.zeros(1, 2)
    behav = torch.tensor([[math.log(0.5), math.log(1 / 6)]])
    adv = torch.ones(1, 2)
    _, stats = decoupled_ppo_loss(logp, prox, behav, adv, torch.ones(1, 2),
                                  cfg=AlgorithmConfig(behav_weight_mode="mask"), num_tokens=2)
    assert stats.behav_masked == 1 and stats.tokens == 2
    assert stats.clipped == 1


def test_minus_infinity_at_a_masked_position_cannot_make_nan():
    # A position outside the loss may hold -inf (a logprob of an impossible token, a padded
    # slot): -inf * 0 is NaN, so masks must select, not multiply.
    inf = float("inf")
    logp = torch.tensor([[-inf, -0.1]], requires_grad=True)
    prox = torch.tensor([[-inf, -0.1]])
    behav = torch.tensor([[-inf, -0.2]])
    ref = torch.tensor([[-inf, -0.1]])
    adv = torch.tensor([[0.0, 1.0]])
    mask = torch.tensor([[0.0, 1.0]])
    cfg = AlgorithmConfig(kl_coef=0.1)
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, cfg=cfg, num_tokens=1,
                                     ref_logp=ref)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert math.isfinite(stats.kl_sum) and math.isfinite(stats.behav_weight_sum)
    assert all(math.isfinite(v) for v in stats.mismatch.values())


def test_masked_positions_cannot_make_nan():
    # A prompt/pad position (mask 0) with a huge logit gap: exp(gap) is inf, times 0 is NaN
    # unless the gap is masked before exp.
    logp = torch.tensor([[0.0, -0.1]], requires_grad=True)
    prox = torch.tensor([[-200.0, -0.1]])
    behav = torch.tensor([[-900.0, -0.1]])
    adv = torch.tensor([[1.0, 1.0]])
    mask = torch.tensor([[0.0, 1.0]])
    for cfg in (AlgorithmConfig(), AlgorithmConfig(kl_coef=0.1)):
        loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, cfg=cfg, num_tokens=1,
                                         ref_logp=torch.tensor([[-300.0, -0.1]]))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
        assert stats.tokens == 1 and math.isfinite(stats.kl_sum)
        logp.grad = None
