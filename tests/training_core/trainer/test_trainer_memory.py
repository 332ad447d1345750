"""Issue 45, trainer memory: logprobs from the hidden states a chunk of tokens at a time (the
full [T, V] fp32 logits never exist) and activation checkpointing give the numbers of the plain
path; the chunks are what the output projection sees, and checkpointing really recomputes."""

from __future__ import annotations

import pytest
import torch

from tests.training_core.test_prefix_tree import _batch, _rows
from training_core.algorithms.loss import decoupled_ppo_loss
from training_core.algorithms.presets import PRESETS
from training_core.config import load_spec
from training_core.models.loading import load_model
from training_core.prefix_tree import (
    output_head,
    prefix_tree_logprobs,
    sequence_logprobs,
)
from training_core.trainer.deepspeed_trainer import DeepSpeedTrainer

CHUNK = 7  # far below the batch's tokens: many chunks, the last one short


def _head_rows(model: torch.nn.Module) -> list[int]:
    """Rows of every call of the output projection (its input's leading dimensions)."""
    rows: list[int] = []
    model.get_output_embeddings().register_forward_hook(
        lambda _m, args, _out: rows.append(int(args[0].shape[:-1].numel())))
    return rows


@pytest.mark.parametrize("tree", [False, True])
def test_chunked_logprobs_equal_the_full_logits_path(tiny_model_dir, tree):
    model = load_model(tiny_model_dir).eval()
    b = _batch(_rows())
    rows = _head_rows(model)
    with torch.no_grad():
        if tree:
            plain = prefix_tree_logprobs(model, b.input_ids, b.attention_mask, b.versions, 0.7,
                                         chunk_tokens=None)
            full_rows = list(rows)
            chunked = prefix_tree_logprobs(model, b.input_ids, b.attention_mask, b.versions, 0.7,
                                           chunk_tokens=CHUNK)
        else:
            plain = sequence_logprobs(model, b.input_ids, b.attention_mask, 0.7, chunk_tokens=None)
            full_rows = list(rows)
            chunked = sequence_logprobs(model, b.input_ids, b.attention_mask, 0.7,
                                        chunk_tokens=CHUNK)
    assert output_head(model) is model.lm_head
    torch.testing.assert_close(chunked, plain, atol=1e-6, rtol=0)
    assert plain.abs().sum() > 10, "the comparison must cover real logprobs"
    # The plain path projects every position at once (the rows, or the forest's nodes); the
    # chunked one never more than CHUNK.
    assert len(full_rows) == 1 and full_rows[0] > 5 * CHUNK
    chunks = rows[len(full_rows):]
    assert max(chunks) <= CHUNK and len(chunks) > 5
    assert model.lm_head.weight is model.model.embed_tokens.weight, "the head is put back"


def test_per_token_temperatures_are_chunked_with_their_rows(tiny_model_dir):
    model = load_model(tiny_model_dir).eval()
    b = _batch(_rows(seed=5))
    temps = 0.5 + torch.rand(b.input_ids.shape[0], b.input_ids.shape[1] - 1, 1,
                             generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = sequence_logprobs(model, b.input_ids, b.attention_mask, temps, chunk_tokens=None)
        chunked = sequence_logprobs(model, b.input_ids, b.attention_mask, temps,
                                    chunk_tokens=CHUNK)
    torch.testing.assert_close(chunked, plain, atol=1e-6, rtol=0)


@pytest.mark.parametrize("tree", [False, True])
def test_chunked_gradients_equal_the_full_logits_path(tiny_model_dir, tree):
    b = _batch(_rows(seed=1))
    weights = torch.randn(b.input_ids.shape, generator=torch.Generator().manual_seed(2))
    weights = weights * b.loss_mask
    grads, calls = [], []
    for chunk in (None, CHUNK):
        model = load_model(tiny_model_dir).train()
        rows = _head_rows(model)
        if tree:
            logp = prefix_tree_logprobs(model, b.input_ids, b.attention_mask, b.versions, 1.0,
                                        chunk_tokens=chunk)
        else:
            logp = sequence_logprobs(model, b.input_ids, b.attention_mask, 1.0, chunk_tokens=chunk)
        forward_calls = len(rows)
        (logp * weights).sum().backward()
        calls.append((forward_calls, len(rows)))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        # The head's gradient is summed over chunks instead of in one product: float order.
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert grads[0]["model.embed_tokens.weight"].abs().sum() > 0
    # Each chunk is projected again in the backward (checkpointed), none kept from the forward.
    (plain_fwd, plain_all), (chunk_fwd, chunk_all) = calls
    assert plain_fwd == plain_all == 1
    assert chunk_fwd > 5 and chunk_all == 2 * chunk_fwd


def test_a_model_whose_logits_are_more_than_the_projection_takes_the_full_logits(tiny_model_dir):
    model = load_model(tiny_model_dir).eval()
    model.config.model_type = "gemma2"  # a soft cap after lm_head: not the plain projection
    assert output_head(model) is None
    rows = _head_rows(model)
    b = _batch(_rows())
    with torch.no_grad():
        sequence_logprobs(model, b.input_ids, b.attention_mask, 1.0, chunk_tokens=CHUNK)
    assert rows == [b.input_ids.numel()]


def _decoder_calls(trainer: DeepSpeedTrainer) -> list[int]:
    """Calls of a module inside the first decoder layer (transformers checkpoints the layer's
    forward, inside its hooks: a hook on the layer itself runs once either way). A pre-hook:
    torch's recompute stops at the last tensor the backward needs, before the MLP returns."""
    calls: list[int] = []
    trainer.engine.module.model.layers[0].mlp.register_forward_pre_hook(
        lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("share", [True, False])
def test_activation_checkpointing_recomputes_and_makes_the_same_update(tiny_model_dir, share):
    b = _batch(_rows(seed=3), seed=3)
    loss_fn = lambda *a, **k: decoupled_ppo_loss(*a, cfg=PRESETS["grpo"], **k)  # noqa: E731
    results = []
    for checkpointing in (False, True):
        t = DeepSpeedTrainer(tiny_model_dir, lr=1e-3, weight_decay=0.0, grad_clip=1e9,
                             zero_stage=0, share_prefixes=share, micro_batch_tokens=10_000,
                             activation_checkpointing=checkpointing, logit_chunk_tokens=CHUNK)
        module = t.engine.module
        name = ("is_activation_checkpointing" if hasattr(type(module), "is_activation_checkpointing")
                else "is_gradient_checkpointing")  # transformers' older name
        assert getattr(module, name) is checkpointing
        proximal = t.logprobs(b)
        calls = _decoder_calls(t)
        stats = t.train_step(b, proximal, loss_fn)
        results.append((stats, len(calls), {k: v.clone() for k, v in t.weights().items()}))
    (plain, plain_calls, w0), (ckpt, ckpt_calls, w1) = results
    # The layer runs once per micro-batch without, and once more in the backward with it.
    assert plain_calls >= 1 and ckpt_calls == 2 * plain_calls
    assert ckpt["loss"] == pytest.approx(plain["loss"], abs=1e-7)
    assert ckpt["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    assert plain["grad_norm"] > 0
    for name in w0:  # Adam's first step: a float-noise gradient may flip sign (~2 lr)
        diff = (w1[name] - w0[name]).abs()
        assert float(diff.max()) <= 2e-3, name
        assert int((diff > 1e-6).sum()) <= max(1, diff.numel() // 1000), name


def test_the_spec_field_defaults_off_and_sizes_a_gpu_sharing_server():
    """The launcher sizes an SGLang server sharing the trainer's GPU by what the trainer needs
    (gpu_memory): 64k-token micro-batches of SmolLM2 in bf16 keep ~38 GiB of activations, more
    than a 40 GiB GPU leaves a server; with checkpointing the server gets three quarters."""
    from training_core import gpu_memory
    from training_core.launch import server_mem_fraction
    from training_core.models.paths import resolve_model_dir

    assert load_spec(None, []).trainer.activation_checkpointing is False
    model_dir = resolve_model_dir("smollm2")
    base = ["model.dtype=bfloat16", "rollout.backend=sglang", "trainer.micro_batch_tokens=65536"]
    plain = load_spec(None, base)
    with pytest.raises(gpu_memory.GpuMemoryError, match="trainer.activation_checkpointing"):
        server_mem_fraction(plain, model_dir, shares_trainer_gpu=True, gpu_bytes=40 * 2**30)
    spec = load_spec(None, [*base, "trainer.activation_checkpointing=true"])
    assert spec.trainer.activation_checkpointing is True
    fraction = server_mem_fraction(spec, model_dir, shares_trainer_gpu=True, gpu_bytes=40 * 2**30)
    assert 0.5 < fraction <= gpu_memory.MAX_SHARED_FRACTION


@pytest.mark.parametrize("stage", [1, 3])
def test_chunks_make_the_same_update_under_zero(tiny_model_dir, stage):
    """The chunks' projections run outside the model's forward (ZeRO-3 gathers lm_head for each
    call, also in the backward's recompute) and the backward starts from the hooks DeepSpeed put
    on the forward's output: the update must still be the full-logits one."""
    b = _batch(_rows(seed=6), seed=6)
    loss_fn = lambda *a, **k: decoupled_ppo_loss(*a, cfg=PRESETS["grpo"], **k)  # noqa: E731
    results = []
    for chunk in (None, CHUNK):
        t = DeepSpeedTrainer(tiny_model_dir, lr=1e-3, weight_decay=0.0, grad_clip=1e9,
                             zero_stage=stage, logit_chunk_tokens=chunk)
        stats = t.train_step(b, t.logprobs(b), loss_fn)
        results.append((stats, {k: v.clone() for k, v in t.weights().items()}))
    (plain, w0), (chunked, w1) = results
    assert chunked["loss"] == pytest.approx(plain["loss"], abs=1e-7)
    assert chunked["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    assert plain["grad_norm"] > 0
    for name in w0:
        diff = (w1[name] - w0[name]).abs()
        assert float(diff.max()) <= 2e-3, name
        assert int((diff > 1e-6).sum()) <= max(1, diff.numel() // 1000), name
