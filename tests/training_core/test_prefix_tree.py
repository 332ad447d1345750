"""Computing each distinct prefix once (``trainer.share_prefixes``, the prefix forest) gives the
same logprobs, gradients and update as running every sample as a whole row."""

from __future__ import annotations

import pytest
import torch

from training_core.algorithms.loss import decoupled_ppo_loss
from training_core.algorithms.presets import PRESETS
from training_core.api import PROMPT_VERSION, TrainBatch
from training_core.config import load_spec
from training_core.models.loading import load_model
from training_core.prefix_tree import (
    build_forest,
    prefix_micro_batches,
    prefix_tree_logprobs,
    sequence_logprobs,
)
from training_core.trainer.deepspeed_trainer import DeepSpeedTrainer


def _rows(seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(tokens, versions) per row, everything the forest has to get right: three prompts of
    different lengths; answers of different lengths; the same answer three times; answers that
    share their first tokens; an answer that is another's prefix; a multi-turn row (feedback
    tokens carry PROMPT_VERSION between generated ones); a row with no generated token; and two
    rows with the same tokens split differently between prompt and answer."""
    g = torch.Generator().manual_seed(seed)

    def toks(n: int) -> list[int]:
        return torch.randint(3, 60, (n,), generator=g).tolist()

    rows = []
    for prompt_len, answer_lens in ((5, [3, 7, 1, 4]), (9, [2, 2, 6, 5]), (3, [8, 4, 0, 3])):
        prompt = toks(prompt_len)
        answers = [toks(n) for n in answer_lens]
        answers.append(answers[1])  # a copy
        answers.append(answers[1][:2] + toks(4))  # the same start, then different
        answers.append(answers[1][:3])  # a prefix of another answer
        for a in answers:
            rows.append((prompt + a, [PROMPT_VERSION] * prompt_len + [2] * len(a)))
    tokens, versions = rows[8]  # multi-turn: answer, feedback, answer
    rows[8] = (tokens + toks(3) + toks(2), versions + [PROMPT_VERSION] * 3 + [3] * 2)
    tokens, versions = rows[0]  # row 0's tokens, one more of them counted as prompt
    rows.append((tokens, [PROMPT_VERSION] * 6 + versions[6:]))
    return rows


def _batch(rows, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    width = max(len(t) for t, _ in rows)
    ids = torch.tensor([t + [0] * (width - len(t)) for t, _ in rows])
    versions = torch.tensor([v + [PROMPT_VERSION] * (width - len(v)) for _, v in rows])
    attention = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t, _ in rows])
    loss_mask = (versions != PROMPT_VERSION).float()
    adv = torch.randn(len(rows), 1, generator=g) * loss_mask
    behav = -torch.rand(ids.shape, generator=g) * 3 * loss_mask
    return TrainBatch(ids, attention, loss_mask, behav, versions, adv)


def _distinct_prefixes(b: TrainBatch) -> int:
    """Prefixes (from the first token) of every row, counted once per prompt split."""
    seen = set()
    lengths = b.attention_mask.sum(-1).tolist()
    starts = ((b.versions != PROMPT_VERSION) & b.attention_mask.bool()).long()
    for i, row in enumerate(b.input_ids.tolist()):
        start = int(starts[i].argmax()) if starts[i].any() else lengths[i]
        for k in range(1, lengths[i] + 1):
            seen.add((tuple(row[:start]), tuple(row[:k])))
    return len(seen)


def test_the_forest_holds_each_distinct_prefix_once():
    b = _batch(_rows())
    forest = build_forest(b.input_ids, b.attention_mask, b.versions)
    real = int((forest.input_ids != 0).sum())  # token ids start at 3: 0 is padding only
    assert real == _distinct_prefixes(b) < int(b.attention_mask.sum())
    # The copy (row 4 of the first group) reads the very same nodes as the answer it copies.
    first_copy = forest.pick[forest.rows == 1]
    assert torch.equal(forest.pick[forest.rows == 4], first_copy)
    # One logprob per distinct generated node, fewer than generated tokens.
    assert len(forest.parents) < int(b.loss_mask.sum()) + 3  # + the multi-turn feedback tokens
    # A node attends to itself; padding to itself only.
    assert forest.allowed.diagonal(dim1=-2, dim2=-1).all()


@pytest.mark.parametrize("budget", [None, 1])
def test_logprobs_equal_the_whole_rows_and_leave_prompts_at_zero(tiny_model_dir, budget,
                                                                   monkeypatch):
    """budget=1: every group is split into parts of the longest sample's size, each part with
    its own copy of the prompt, several parts sharing a row."""
    if budget is not None:
        monkeypatch.setattr("training_core.prefix_tree.ROW_FACTOR", budget)
    model = load_model(tiny_model_dir).eval()
    b = _batch(_rows())
    with torch.no_grad():
        whole = sequence_logprobs(model, b.input_ids, b.attention_mask, 0.7)
        tree = prefix_tree_logprobs(model, b.input_ids, b.attention_mask, b.versions, 0.7)
    lengths = b.attention_mask.sum(-1)
    starts = ((b.versions != PROMPT_VERSION) & b.attention_mask.bool()).long().argmax(-1)
    computed = torch.zeros_like(b.loss_mask, dtype=torch.bool)
    for i in range(len(lengths)):
        if b.loss_mask[i].any():
            computed[i, int(starts[i]): int(lengths[i])] = True
    assert int(computed.sum()) > 80
    # Every generated token and the multi-turn row's feedback tokens (inputs, not prompt).
    torch.testing.assert_close(tree[computed], whole[computed], atol=2e-5, rtol=1e-5)
    assert (tree[~computed] == 0).all(), "prompt columns, padding and rows with no answer stay 0"


def test_eager_attention_takes_an_additive_mask_with_the_same_result(tiny_model_dir):
    model = load_model(tiny_model_dir).eval()
    model.config._attn_implementation = "eager"
    b = _batch(_rows(seed=4))
    with torch.no_grad():
        whole = sequence_logprobs(model, b.input_ids, b.attention_mask, 1.0)
        tree = prefix_tree_logprobs(model, b.input_ids, b.attention_mask, b.versions, 1.0)
    generated = b.loss_mask.bool()
    torch.testing.assert_close(tree[generated], whole[generated], atol=2e-5, rtol=1e-5)


def test_gradients_equal_those_of_the_whole_rows(tiny_model_dir):
    b = _batch(_rows(seed=1))
    weights = torch.randn(b.input_ids.shape, generator=torch.Generator().manual_seed(2))
    weights = weights * b.loss_mask
    grads = []
    for tree in (False, True):
        model = load_model(tiny_model_dir).train()
        if tree:
            logp = prefix_tree_logprobs(model, b.input_ids, b.attention_mask, b.versions, 1.0)
        else:
            logp = sequence_logprobs(model, b.input_ids, b.attention_mask, 1.0)
        (logp * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert any(g.abs().sum() > 0 for g in grads[0].values())


def test_an_update_with_shared_prefixes_matches_one_without(tiny_model_dir):
    b = _batch(_rows(seed=3), seed=3)
    loss_fn = lambda *a, **k: decoupled_ppo_loss(*a, cfg=PRESETS["grpo"], **k)  # noqa: E731
    results = []
    for share in (False, True):
        t = DeepSpeedTrainer(tiny_model_dir, lr=1e-3, weight_decay=0.0, grad_clip=1e9,
                             zero_stage=0, share_prefixes=share)
        proximal = t.logprobs(b)  # the separate pass (several minibatches) shares as well
        stats = t.train_step(b, proximal, loss_fn)
        results.append((proximal, stats, {k: v.clone() for k, v in t.weights().items()}))
    (prox0, stats0, w0), (prox1, stats1, w1) = results
    generated = b.loss_mask.bool()
    torch.testing.assert_close(prox1[generated], prox0[generated], atol=2e-5, rtol=1e-5)
    assert abs(stats0["loss"] - stats1["loss"]) < 1e-6
    assert abs(stats0["grad_norm"] - stats1["grad_norm"]) < 1e-5 * stats0["grad_norm"]
    assert stats0["tokens"] == stats1["tokens"] == float(b.loss_mask.sum())
    base = load_model(tiny_model_dir).state_dict()
    moved = 0.0
    for name in w0:
        # Adam's first step moves a weight by about lr * sign(grad); a gradient that is float
        # noise may flip sign, so allow ~2 lr on a handful of elements.
        diff = (w1[name] - w0[name]).abs()
        assert float(diff.max()) <= 2e-3, name
        assert int((diff > 1e-6).sum()) <= max(1, diff.numel() // 1000), name
        moved += float((w0[name] - base[name]).abs().sum())
    assert moved > 0, "the update must change the weights for the comparison to mean anything"


def test_micro_batches_keep_groups_together_within_the_token_budget():
    b = _batch(_rows())
    lengths = b.lengths
    batches = prefix_micro_batches(b.input_ids, lengths, 60)
    assert sorted(i for mb in batches for i in mb) == list(range(len(lengths)))
    for mb in batches:
        assert sum(lengths[i] for i in mb) <= 60 or len(mb) == 1
    # Token order: a group's rows are contiguous, so each prompt spans as few batches as it can.
    prompts = [tuple(r[:3]) for r in b.input_ids.tolist()]
    order = [i for mb in batches for i in mb]
    runs = sum(1 for a, c in zip(order, order[1:], strict=False) if prompts[a] != prompts[c]) + 1
    assert runs == len(set(prompts))
    assert prefix_micro_batches(b.input_ids, lengths, 10**6) == [sorted(
        range(len(lengths)), key=lambda i: b.input_ids[i, : lengths[i]].tolist())]


def test_specs_naming_the_retired_keys_still_load():
    assert load_spec(None, []).trainer.share_prefixes is True
    assert load_spec(None, ["trainer.share_prompts=true", "trainer.dedupe_samples=true"]
                     ).trainer.share_prefixes is True
    assert load_spec(None, ["trainer.dedupe_samples=false"]).trainer.share_prefixes is False
    assert load_spec(None, ["trainer.share_prompts=false"]).trainer.share_prefixes is False
