"""Computing each distinct prompt once (``trainer.share_prompts``) gives the same logprobs and
the same gradients as running every row whole."""

from __future__ import annotations

import torch

from training_core.algorithms.loss import decoupled_ppo_loss
from training_core.algorithms.presets import PRESETS
from training_core.api import PROMPT_VERSION, TrainBatch
from training_core.engines.deepspeed_trainer import (
    DeepSpeedTrainer,
    sequence_logprobs,
    shared_prompt_logprobs,
)
from training_core.models.loading import load_model


def _rows(seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(tokens, versions) per row: three groups of four answers to prompts of different
    lengths, answers of different lengths, one multi-turn row (feedback tokens carry
    PROMPT_VERSION between generated ones) and one row with no generated token."""
    g = torch.Generator().manual_seed(seed)

    def toks(n: int) -> list[int]:
        return torch.randint(3, 60, (n,), generator=g).tolist()

    rows = []
    for prompt_len, answer_lens in ((5, [3, 7, 1, 4]), (9, [2, 2, 6, 5]), (3, [8, 4, 0, 3])):
        prompt = toks(prompt_len)
        for n in answer_lens:
            rows.append((prompt + toks(n), [PROMPT_VERSION] * prompt_len + [2] * n))
    tokens, versions = rows[5]  # multi-turn: answer, feedback, answer
    rows[5] = (tokens + toks(3) + toks(2), versions + [PROMPT_VERSION] * 3 + [3] * 2)
    return rows


def _batch(rows) -> TrainBatch:
    width = max(len(t) for t, _ in rows)
    ids = torch.tensor([t + [0] * (width - len(t)) for t, _ in rows])
    versions = torch.tensor([v + [PROMPT_VERSION] * (width - len(v)) for _, v in rows])
    attention = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t, _ in rows])
    loss_mask = (versions != PROMPT_VERSION).float()
    adv = torch.linspace(-1, 1, len(rows)).view(-1, 1) * loss_mask
    return TrainBatch(ids, attention, loss_mask, torch.zeros_like(loss_mask), versions, adv)


def test_shared_prompt_logprobs_equal_the_whole_rows_and_leave_prompts_at_zero(tiny_model_dir):
    model = load_model(tiny_model_dir).eval()
    b = _batch(_rows())
    with torch.no_grad():
        whole = sequence_logprobs(model, b.input_ids, b.attention_mask, 0.7)
        shared = shared_prompt_logprobs(model, b.input_ids, b.attention_mask, b.versions, 0.7)
    generated = b.versions != PROMPT_VERSION
    assert generated.sum() > 40
    torch.testing.assert_close(shared[generated], whole[generated], atol=2e-5, rtol=1e-5)
    # The multi-turn row's feedback tokens are computed too (they are inputs, not prompt).
    first = int(generated[5].nonzero()[0])
    last = int(b.attention_mask[5].sum()) - 1
    torch.testing.assert_close(shared[5, first:last + 1], whole[5, first:last + 1],
                               atol=2e-5, rtol=1e-5)
    assert (shared[:, :3] == 0).all(), "columns before the first generated token stay 0"


def test_shared_prompt_gradients_equal_the_whole_rows(tiny_model_dir):
    b = _batch(_rows(seed=1))
    weights = torch.randn(b.input_ids.shape, generator=torch.Generator().manual_seed(2))
    weights = weights * b.loss_mask
    grads = []
    for fn in (sequence_logprobs, None):
        model = load_model(tiny_model_dir).train()
        if fn is None:
            logp = shared_prompt_logprobs(model, b.input_ids, b.attention_mask, b.versions, 1.0)
        else:
            logp = fn(model, b.input_ids, b.attention_mask, 1.0)
        (logp * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert any(g.abs().sum() > 0 for g in grads[0].values())


def test_rows_that_share_no_prompt_take_the_whole_row_path(tiny_model_dir):
    model = load_model(tiny_model_dir).eval()
    rows = _rows()
    b = _batch([rows[0], rows[4], rows[8]])  # one row per group
    with torch.no_grad():
        whole = sequence_logprobs(model, b.input_ids, b.attention_mask, 1.0)
        shared = shared_prompt_logprobs(model, b.input_ids, b.attention_mask, b.versions, 1.0)
    assert torch.equal(shared, whole)


def test_an_update_with_shared_prompts_matches_one_without(tiny_model_dir):
    b = _batch(_rows(seed=3))
    loss_fn = lambda *a, **k: decoupled_ppo_loss(*a, cfg=PRESETS["grpo"], **k)  # noqa: E731
    weights, losses, norms = [], [], []
    for share in (False, True):
        t = DeepSpeedTrainer(tiny_model_dir, lr=1e-3, weight_decay=0.0, grad_clip=1e9,
                             zero_stage=0, share_prompts=share)
        b.behav_logp = t.logprobs(b)
        stats = t.train_step(b, None, loss_fn)
        losses.append(stats["loss"])
        norms.append(stats["grad_norm"])
        weights.append({k: v.clone() for k, v in t.weights().items()})
    assert abs(losses[0] - losses[1]) < 1e-6
    assert abs(norms[0] - norms[1]) < 1e-5 * norms[0]
    moved, elements, off = 0.0, 0, 0
    base = load_model(tiny_model_dir).state_dict()
    for name, w in weights[0].items():
        # Adam's first step moves a weight by about lr * sign(grad): one whose gradient is float
        # noise (|g| ~ 1e-9) may move differently, by at most ~2 lr. Every other one must agree.
        diff = (weights[1][name] - w).abs()
        assert float(diff.max()) <= 2e-3, name
        off += int((diff > 1e-6).sum())
        elements += diff.numel()
        moved += float((w - base[name]).abs().sum())
    assert off <= elements // 1000, f"{off} of {elements} weights differ by more than 1e-6"
    assert moved > 0, "the update must change the weights for the comparison to mean anything"
