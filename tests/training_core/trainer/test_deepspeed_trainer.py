"""The DeepSpeed trainer engine on CPU (gloo): update direction, micro-batching, weight export."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from training_core.algorithms.loss import decoupled_ppo_loss
from training_core.algorithms.presets import PRESETS
from training_core.api import TrainBatch
from training_core.trainer.deepspeed_trainer import DeepSpeedTrainer, pack_micro_batches


def _batch(n=4, length=10, prompt=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 60, (n, length), generator=g)
    mask = torch.zeros(n, length)
    mask[:, prompt:] = 1
    adv = torch.tensor([1.0, -1.0] * (n // 2)).view(-1, 1) * mask
    return TrainBatch(ids, torch.ones(n, length, dtype=torch.long), mask, torch.zeros(n, length),
                      torch.zeros(n, length, dtype=torch.long), adv)


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    return DeepSpeedTrainer(tiny_model_dir, lr=1e-3, weight_decay=0.0, grad_clip=10.0,
                            zero_stage=0, micro_batch_tokens=20)


def test_pack_micro_batches_respects_the_token_budget():
    lengths = [10, 3, 7, 7, 2, 9]
    batches = pack_micro_batches(lengths, 16)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert max(lengths[i] for i in b) * len(b) <= 16 or len(b) == 1


def test_update_moves_likelihood_along_the_advantage(trainer):
    b = _batch()
    prox = trainer.logprobs(b)
    b.behav_logp = prox.clone()
    loss_fn = lambda *a, **k: decoupled_ppo_loss(*a, cfg=PRESETS["grpo"], **k)  # noqa: E731
    stats = trainer.train_step(b, prox, loss_fn)
    after = trainer.logprobs(b)
    delta = ((after - prox) * b.loss_mask).sum(-1)
    assert delta[0] > 0 and delta[2] > 0, "positive advantage must gain likelihood"
    assert delta[1] < 0 and delta[3] < 0, "negative advantage must lose likelihood"
    assert stats["grad_norm"] > 0 and stats["tokens"] == b.loss_mask.sum()


def test_micro_batching_matches_one_big_batch(tiny_model_dir):
    b = _batch(n=6, seed=1)
    loss_fn = lambda *a, **k: decoupled_ppo_loss(*a, cfg=PRESETS["grpo"], **k)  # noqa: E731
    results = []
    for budget in (10_000, 20):  # one micro-batch vs. one sample per micro-batch
        torch.manual_seed(0)
        t = DeepSpeedTrainer(tiny_model_dir, lr=1e-3, weight_decay=0.0, grad_clip=1e9,
                             zero_stage=0, micro_batch_tokens=budget)
        prox = t.logprobs(b)
        stats = t.train_step(b, prox, loss_fn)
        results.append((stats["grad_norm"], stats["loss"]))
    (g1, l1), (g2, l2) = results
    assert g1 == pytest.approx(g2, rel=1e-4) and l1 == pytest.approx(l2, abs=1e-6)


def test_exported_weights_load_into_the_model(trainer, tmp_path, tiny_model_dir):
    path = trainer.save_weights(tmp_path / "v1")
    state = load_file(str(path / "model.safetensors"))
    own = trainer.engine.module.state_dict()
    assert "lm_head.weight" not in state  # tied: the server re-ties on load
    for k, v in state.items():
        assert torch.equal(v, own[k].cpu())


def test_pack_micro_batches_never_pads_a_sample_past_twice_its_length():
    lengths = [96] * 3 + [20] * 40
    for b in pack_micro_batches(lengths, 8192):
        longest = max(lengths[i] for i in b)
        assert all(2 * lengths[i] >= longest for i in b)


def test_zero_stages_give_the_same_update_on_cpu(tiny_model_dir, tmp_path):
    """trainer.zero_stage changes how state is partitioned, never the maths."""
    loss_fn = lambda *a, **k: decoupled_ppo_loss(*a, cfg=PRESETS["grpo"], **k)  # noqa: E731
    results = {}
    for stage in (0, 1, 2, 3):
        t = DeepSpeedTrainer(tiny_model_dir, lr=1e-3, weight_decay=0.0, grad_clip=10.0, zero_stage=stage)
        b = _batch(seed=3)
        prox = t.logprobs(b)
        b.behav_logp = prox.clone()
        stats = t.train_step(b, prox, loss_fn)
        delta = ((t.logprobs(b) - prox) * b.loss_mask).sum(-1)
        # Each stage's export written over the stage before's folder (weight_files' spare)
        spare = tmp_path / f"z{stage - 1}" if stage else None
        inode = (spare / "model.safetensors").stat().st_ino if spare else None
        folder = t.save_weights(tmp_path / f"z{stage}", spare=spare)
        assert inode is None or (folder / "model.safetensors").stat().st_ino == inode
        exported = load_file(str(folder / "model.safetensors"))
        results[stage] = (stats["grad_norm"], delta, exported["model.norm.weight"])
    g0, d0, w0 = results[0]
    for stage in (1, 2, 3):
        g, d, w = results[stage]
        assert g == pytest.approx(g0, rel=1e-4)
        assert torch.allclose(d, d0, atol=1e-4) and torch.allclose(w, w0, atol=1e-6)


def test_dropout_is_off_so_the_first_ratio_is_exactly_one(tiny_model_dir, tmp_path):
    """Proximal logprobs run in eval mode, the update in train mode: with a model whose config
    asks for dropout, the PPO ratio must still be exactly 1 before the first optimizer step."""
    import shutil

    from transformers import AutoConfig

    model_dir = tmp_path / "dropout-model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    config.attention_dropout = 0.5
    config.save_pretrained(model_dir)
    trainer = DeepSpeedTrainer(model_dir, lr=1e-3, weight_decay=0.0, grad_clip=10.0,
                               zero_stage=0, micro_batch_tokens=1000)
    b = _batch()
    prox = trainer.logprobs(b)
    seen = []

    def recording_loss(logp, prox_logp, *args, **kwargs):
        if not seen:  # the first micro-batch, before any optimizer step
            seen.append(((logp - prox_logp) * args[2]).detach().abs().max().item())
        return decoupled_ppo_loss(logp, prox_logp, *args, cfg=PRESETS["grpo"], **kwargs)

    trainer.train_step(b, prox, recording_loss)
    assert seen == [0.0]
    module = trainer.engine.module
    assert all(getattr(m, "attention_dropout", 0.0) == 0.0 for m in module.modules())


def test_proximal_pass_recomputes_stale_rows_and_keeps_fresh_ones(trainer):
    """Fresh rows keep their behaviour logprobs (the server's logprobs equal a trainer forward in
    the same dtype: test_embedded_server.py::test_logprobs_match_a_full_forward_pass); stale rows
    get exactly what a full recompute gives them, whatever rows they are packed with."""
    from training_core.config import load_spec
    from training_core.train import proximal_and_reference

    b = _batch(n=6, seed=3)
    b.behav_logp = torch.full_like(b.behav_logp, -7.0) * b.loss_mask  # recognisable
    b.versions = torch.full_like(b.versions, 5)
    b.versions[[1, 4], -1] = 4  # one older token makes a row stale
    full = trainer.logprobs(b)
    spec = load_spec(None, ["model.path=tiny", "trainer.ppo_minibatches=2"])
    prox, ref, recomputed = proximal_and_reference(trainer, b, PRESETS["grpo"], spec, 5)
    assert recomputed == 2 and ref is None
    assert torch.allclose(prox[[1, 4]], full[[1, 4]], atol=1e-6)
    assert torch.equal(prox[[0, 2, 3, 5]], b.behav_logp[[0, 2, 3, 5]])
    always = load_spec(None, ["model.path=tiny", "trainer.recompute_proximal=always",
                              "trainer.ppo_minibatches=2"])
    prox, _, recomputed = proximal_and_reference(trainer, b, PRESETS["grpo"], always, 5)
    assert recomputed == 6 and torch.allclose(prox, full, atol=1e-6)
    # Specs from before the modes keep their meaning.
    assert load_spec(None, ["trainer.recompute_proximal=true"]).trainer.recompute_proximal == "always"
    assert load_spec(None, ["trainer.recompute_proximal=false"]).trainer.recompute_proximal == "never"


def test_trainer_borrows_the_servers_threads_only_while_they_idle(monkeypatch):
    import os
    from types import SimpleNamespace

    from training_core.config import load_spec
    from training_core.thread_share import ThreadShare

    spec = load_spec(None, ["model.path=tiny", "trainer.threads=1", "rollout.server_threads=1"])
    fleet = SimpleNamespace(urls=["http://127.0.0.1:1", "http://127.0.0.1:2"])
    in_flight = [0]
    executor = SimpleNamespace(in_flight=lambda: in_flight[0])
    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    try:
        share = ThreadShare(spec, fleet, executor, world=1)
        share.update()
        assert torch.get_num_threads() == 3  # its own and both idle servers'
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
        ThreadShare(spec, fleet, executor, world=1).update()
        assert torch.get_num_threads() == 2, "never more threads than cores"
        in_flight[0] = 5
        share.update()
        assert torch.get_num_threads() == 1  # generation runs: give them back
        assert share.release() == 1 and torch.get_num_threads() == 1
        # Several ranks, remote servers or the option off: never.
        for off in (ThreadShare(spec, fleet, executor, world=2), ThreadShare(spec, None, executor, 1),
                    ThreadShare(load_spec(None, ["trainer.borrow_idle_threads=false"]), fleet,
                                executor, 1)):
            in_flight[0] = 0
            off.update()
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_one_minibatch_takes_the_proximal_logprobs_from_its_own_forward(tiny_model_dir):
    """prox_logp=None (one optimizer step per batch): the same loss, gradient and new weights as
    a separate proximal pass, and that pass is gone."""
    b = _batch(n=6, seed=4)
    b.behav_logp = b.behav_logp - 0.3 * b.loss_mask  # off-policy rows: w != 1 matters
    loss_fn = lambda *a, **k: decoupled_ppo_loss(*a, cfg=PRESETS["grpo"], **k)  # noqa: E731
    out = []
    for separate in (True, False):
        torch.manual_seed(0)
        t = DeepSpeedTrainer(tiny_model_dir, lr=1e-3, weight_decay=0.0, grad_clip=1e9,
                             zero_stage=0, micro_batch_tokens=20)
        stats = t.train_step(b, t.logprobs(b) if separate else None, loss_fn)
        out.append((stats, t.logprobs(b)))
    (s1, after1), (s2, after2) = out
    assert s1["loss"] == pytest.approx(s2["loss"], abs=1e-6)
    assert s1["grad_norm"] == pytest.approx(s2["grad_norm"], rel=1e-5)
    assert s1["behav_weight_sum"] == pytest.approx(s2["behav_weight_sum"], rel=1e-5)
    assert torch.allclose(after1, after2, atol=1e-6)
    with pytest.raises(ValueError, match="minibatches"):
        DeepSpeedTrainer(tiny_model_dir, lr=1e-3, weight_decay=0.0, grad_clip=1.0,
                         zero_stage=0).train_step(b, None, loss_fn, minibatches=2)


def _with_zero_rows(seed: int) -> TrainBatch:
    """Rows 1 and 4 have zero advantage (a group all right or all wrong), row 3 no loss token
    (dropped as too stale); the others carry the gradient."""
    b = _batch(n=6, seed=seed)
    b.advantages[1] = 0.0
    b.advantages[4] = 0.0
    b.loss_mask[3] = 0.0
    b.advantages[3] = 0.0
    return b


def test_rows_with_gradient_are_those_with_a_nonzero_advantage_or_any_loss_token_under_kl():
    from training_core.batching import rows_with_gradient

    b = _with_zero_rows(seed=5)
    assert rows_with_gradient(b, kl=False) == [0, 2, 5]
    assert rows_with_gradient(b, kl=True) == [0, 1, 2, 4, 5], "KL pulls on every loss token"


@pytest.mark.parametrize("minibatches", [1, 3])
def test_skipping_rows_without_gradient_gives_the_same_update(tiny_model_dir, minibatches):
    """Same weights after two updates (AdamW state included), same loss, token count and clip
    fraction; one minibatch of the three has no row with a gradient (its step still runs)."""
    from training_core.batching import rows_with_gradient

    loss_fn = lambda *a, **k: decoupled_ppo_loss(*a, cfg=PRESETS["grpo"], **k)  # noqa: E731
    results = []
    for skip in (False, True):
        t = DeepSpeedTrainer(tiny_model_dir, lr=1e-3, weight_decay=0.1, grad_clip=1e9,
                             zero_stage=0, micro_batch_tokens=25)
        steps = []
        for seed in (7, 8):
            b = _with_zero_rows(seed)
            b.behav_logp = t.logprobs(b)
            rows = rows_with_gradient(b, kl=False) if skip else None
            prox = t.logprobs(b) if minibatches > 1 else None
            steps.append(t.train_step(b, prox, loss_fn, minibatches=minibatches, compute_rows=rows))
        results.append((steps, {k: v.clone() for k, v in t.engine.module.state_dict().items()}))
    (full, w_full), (skipped, w_skipped) = results
    for a, b in zip(full, skipped, strict=True):
        # Up to float summation order: the micro-batches hold other rows.
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["tokens"] == a["tokens"] and b["clipped"] == a["clipped"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["computed_rows"] < a["computed_rows"] == 6
    # Adam divides each gradient by its own running magnitude: an element whose gradient is
    # rounding noise (~1e-9, other summation orders) can move up to ~lr a step either way. So
    # weights agree to 1e-4 except a handful of such elements, which stay within that bound.
    lr_steps = 1e-3 * 2 * minibatches
    off = total = 0
    for k, v in w_full.items():
        diff = (w_skipped[k] - v).abs()
        assert diff.max() <= lr_steps, f"{k}: {diff.max():.2e} apart, more than Adam can move"
        off += int((diff > 1e-4 + 1e-4 * v.abs()).sum())
        total += v.numel()
    assert off <= total * 1e-4, f"{off} of {total} weights differ"
    if minibatches == 3:  # chunks [0, 3], [1, 4], [2, 5]: the second has no gradient
        assert skipped[0]["computed_rows"] == 1 + 1 + 2


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_bf16_autocasts_over_fp32_master_weights(tiny_model_dir, zero_stage):
    """``model.dtype: bfloat16``: weights and optimizer stay fp32 (an update far below bf16's
    resolution still lands), forwards run in bf16 (logprobs differ from fp32's, slightly), the
    proximal pass and the update compute the same numbers (the first ratio is exactly 1), and
    the weights pushed to the servers are the master weights in bf16, the servers' dtype."""
    lr = 1e-6  # Adam moves each weight by ~lr: 1/1000 of bf16's step near 0.1
    bf16 = DeepSpeedTrainer(tiny_model_dir, lr=lr, weight_decay=0.0, grad_clip=10.0,
                            zero_stage=zero_stage, dtype="bfloat16", micro_batch_tokens=1000)
    fp32 = DeepSpeedTrainer(tiny_model_dir, lr=lr, weight_decay=0.0, grad_clip=10.0,
                            zero_stage=zero_stage, micro_batch_tokens=1000)
    b = _batch()

    def master() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in bf16.engine.module.state_dict().items()}

    before = master()
    assert all(v.dtype == torch.float32 for v in before.values())
    pushed = bf16.weights()
    assert pushed and all(v.dtype == torch.bfloat16 for v in pushed.values())
    assert all(torch.equal(v, before[k].bfloat16()) for k, v in pushed.items())
    prox = bf16.logprobs(b)
    gap = (prox - fp32.logprobs(b))[b.loss_mask.bool()].abs().max()
    assert 0 < gap < 0.05, f"bf16 autocast logprobs off fp32 by {gap}"
    seen = []

    def recording_loss(logp, prox_logp, *args, **kwargs):
        if not seen:
            seen.append(((logp - prox_logp) * args[2]).detach().abs().max().item())
        return decoupled_ppo_loss(logp, prox_logp, *args, cfg=PRESETS["grpo"], **kwargs)

    bf16.train_step(b, prox, recording_loss)
    assert seen == [0.0]
    after = master()
    moved = [(after[k] - before[k]).abs().max().item() for k in before]
    assert max(moved) > 0.5 * lr
    # Held in bf16, most of that update would have rounded away.
    w0 = torch.cat([before[k].flatten() for k in before])
    w1 = torch.cat([after[k].flatten() for k in before])
    big = w0.abs() > 1e-2
    assert (w1 != w0)[big].float().mean() > 0.9
    assert (w1.bfloat16() == w0.bfloat16())[big].float().mean() > 0.9


def test_a_parameter_the_loss_misses_still_steps_on_a_single_rank(tiny_model_dir):
    """One rank skips DeepSpeed's gradient reduction (it only copied buffers), and with it the
    zero gradient that reduction gives a trainable parameter without one: AdamW must still
    step that parameter (here: decay it), as it does on every rank of a multi-rank run."""
    lr, decay = 1e-2, 0.1
    t = DeepSpeedTrainer(tiny_model_dir, lr=lr, weight_decay=decay, grad_clip=10.0, zero_stage=0)
    assert not t.engine.enable_backward_allreduce
    norm = dict(t.engine.module.named_parameters())["model.norm.weight"]
    before = norm.detach().clone()
    loss_fn = lambda *a, **k: decoupled_ppo_loss(*a, cfg=PRESETS["grpo"], **k)  # noqa: E731

    def missed_by_the_forward(*args, **kwargs):
        norm.requires_grad_(True)  # trainable again, but the graph was built without it
        return loss_fn(*args, **kwargs)

    b = _batch(seed=5)
    prox = t.logprobs(b)
    b.behav_logp = prox.clone()
    t.train_step(b, prox, missed_by_the_forward, before_micro_batch=lambda: norm.requires_grad_(False))
    assert norm.requires_grad
    torch.testing.assert_close(norm.detach(), before * (1 - lr * decay))


def test_per_token_temperatures_are_the_ones_sampled_at(trainer):
    """An agent's own temperature (rollout.agent.sampling: pass) travels with its tokens: the
    trainer's logprobs of a token are at the temperature it was sampled at (0: the run's)."""
    b = _batch(n=2, seed=3)
    at_run = trainer.logprobs(b)  # the run's temperature (1.0)
    b.temperatures = torch.zeros_like(b.behav_logp)
    assert torch.allclose(trainer.logprobs(b), at_run, atol=1e-5)  # 0 = the run's
    b.temperatures[1, 7:] = 0.5  # row 1's last tokens were sampled at 0.5
    mixed = trainer.logprobs(b)
    assert torch.allclose(mixed[0], at_run[0], atol=1e-5)
    assert torch.allclose(mixed[1, :7], at_run[1, :7], atol=1e-5)
    trainer.temperature = 0.5
    try:
        half = trainer.logprobs(TrainBatch(b.input_ids, b.attention_mask, b.loss_mask,
                                           b.behav_logp, b.versions, b.advantages))
    finally:
        trainer.temperature = 1.0
    assert torch.allclose(mixed[1, 7:], half[1, 7:], atol=1e-5)
    assert not torch.allclose(mixed[1, 7:], at_run[1, 7:], atol=1e-3)
