"""Computing each distinct sample once (``trainer.dedupe_samples``) gives the same logprobs, the
same gradients and the same update as computing every copy."""

from __future__ import annotations

import pytest
import torch

from training_core.algorithms.loss import decoupled_ppo_loss
from training_core.algorithms.presets import PRESETS
from training_core.api import PROMPT_VERSION, TrainBatch
from training_core.engines.deepspeed_trainer import DeepSpeedTrainer, distinct_samples


def _batch(seed: int = 0) -> TrainBatch:
    """Two groups of six answers, three distinct per group (one of them three times), answers of
    different lengths, different behaviour logprobs and advantages for every copy."""
    g = torch.Generator().manual_seed(seed)

    def toks(n: int) -> list[int]:
        return torch.randint(3, 60, (n,), generator=g).tolist()

    rows = []
    for prompt_len in (6, 9):
        prompt = toks(prompt_len)
        answers = [toks(4), toks(7), toks(2)]
        for k in (0, 1, 0, 2, 0, 1):
            rows.append((prompt + answers[k], [PROMPT_VERSION] * prompt_len + [1] * len(answers[k])))
    width = max(len(t) for t, _ in rows)
    ids = torch.tensor([t + [0] * (width - len(t)) for t, _ in rows])
    versions = torch.tensor([v + [PROMPT_VERSION] * (width - len(v)) for _, v in rows])
    attention = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t, _ in rows])
    loss_mask = (versions != PROMPT_VERSION).float()
    adv = torch.randn(len(rows), 1, generator=g) * loss_mask
    behav = -torch.rand(ids.shape, generator=g) * 3 * loss_mask
    return TrainBatch(ids, attention, loss_mask, behav, versions, adv)


def test_copies_map_to_their_first_row_and_distinct_rows_give_none():
    b = _batch()
    keep, inverse = distinct_samples(b.input_ids, b.attention_mask, b.versions)
    assert keep.tolist() == [0, 1, 3, 6, 7, 9]
    assert inverse.tolist() == [0, 1, 0, 2, 0, 1, 3, 4, 3, 5, 3, 4]
    assert torch.equal(b.input_ids[keep][inverse], b.input_ids)
    assert distinct_samples(b.input_ids[keep], b.attention_mask[keep], b.versions[keep]) is None


def test_the_same_tokens_split_differently_between_prompt_and_answer_stay_apart():
    """Row 1's prompt is row 0's prompt plus its first answer token: the same tokens, but the
    trainer computes logprobs from a different column on, so they are not copies."""
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    versions = torch.tensor([[-1, -1, 0, 0], [-1, -1, -1, 0]])
    assert distinct_samples(ids, torch.ones_like(ids), versions) is None


@pytest.mark.parametrize("share_prompts", [True, False])
def test_logprobs_and_gradients_equal_those_of_every_copy(tiny_model_dir, share_prompts):
    b = _batch(seed=1)
    weights = torch.randn(b.input_ids.shape, generator=torch.Generator().manual_seed(2)) * b.loss_mask
    logps, grads = [], []
    for dedupe in (False, True):
        t = DeepSpeedTrainer(tiny_model_dir, lr=1e-3, weight_decay=0.0, grad_clip=1e9,
                             zero_stage=0, share_prompts=share_prompts, dedupe_samples=dedupe)
        module = t.engine.module.train()
        logp = t._forward_logprobs(module, b)
        (logp * weights).sum().backward()
        logps.append(logp.detach())
        grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
    generated = b.loss_mask.bool()
    torch.testing.assert_close(logps[1][generated], logps[0][generated], atol=2e-5, rtol=1e-5)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert any(g.abs().sum() > 0 for g in grads[0].values())


def test_an_update_with_copies_computed_once_matches_one_without(tiny_model_dir):
    b = _batch(seed=3)
    loss_fn = lambda *a, **k: decoupled_ppo_loss(*a, cfg=PRESETS["grpo"], **k)  # noqa: E731
    results = []
    for dedupe in (False, True):
        t = DeepSpeedTrainer(tiny_model_dir, lr=1e-3, weight_decay=0.0, grad_clip=1e9,
                             zero_stage=0, dedupe_samples=dedupe)
        proximal = t.logprobs(b)  # the separate pass (several minibatches) dedupes as well
        stats = t.train_step(b, proximal, loss_fn)
        results.append((proximal, stats, {k: v.clone() for k, v in t.weights().items()}))
    (prox0, stats0, w0), (prox1, stats1, w1) = results
    torch.testing.assert_close(prox1, prox0, atol=2e-5, rtol=1e-5)
    assert abs(stats0["loss"] - stats1["loss"]) < 1e-6
    assert abs(stats0["grad_norm"] - stats1["grad_norm"]) < 1e-5 * stats0["grad_norm"]
    assert stats0["tokens"] == stats1["tokens"] == float(b.loss_mask.sum())
    for name in w0:
        # Adam's first step moves a weight by about lr * sign(grad); a gradient that is float
        # noise may flip sign, so allow ~2 lr on a handful of elements.
        diff = (w1[name] - w0[name]).abs()
        assert float(diff.max()) <= 2e-3, name
        assert int((diff > 1e-6).sum()) <= max(1, diff.numel() // 1000), name
