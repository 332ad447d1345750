"""LoRA in the trainer (issue 49.1): only the adapter trains and is optimized, the KL reference is
the base with the adapter off, the export is the adapter alone, and a resume is exact."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.training_core.trainer.test_deepspeed_trainer import _batch
from training_core.algorithms.loss import decoupled_ppo_loss
from training_core.algorithms.presets import PRESETS
from training_core.config import LoraSpec
from training_core.models.loading import load_model
from training_core.trainer.deepspeed_trainer import DeepSpeedTrainer

LOSS = lambda *a, **k: decoupled_ppo_loss(*a, cfg=PRESETS["grpo"], **k)  # noqa: E731


def _trainer(model_dir, **kw) -> DeepSpeedTrainer:
    torch.manual_seed(0)  # the adapter's A matrices are drawn at random
    return DeepSpeedTrainer(model_dir, lr=1e-2, weight_decay=0.0, grad_clip=10.0, zero_stage=0,
                            micro_batch_tokens=20, lora=LoraSpec(rank=4, alpha=8), **kw)


def _step(t: DeepSpeedTrainer, seed: int) -> dict[str, float]:
    b = _batch(seed=seed)
    b.behav_logp = t.logprobs(b)
    return t.train_step(b, None, LOSS)


def _adapter_and_optimizer(t: DeepSpeedTrainer) -> tuple[dict, list]:
    weights = {n: p.detach().clone() for n, p in t.engine.module.named_parameters()
               if p.requires_grad}
    state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for s in t.optimizer.state_dict()["state"].values()]
    return weights, state


def test_the_optimizer_holds_only_the_adapter_and_the_base_never_moves(tiny_model_dir):
    t = _trainer(tiny_model_dir)
    names = {id(p): n for n, p in t.engine.module.named_parameters()}
    optimized = [names[id(p)] for g in t.optimizer.param_groups for p in g["params"]]
    assert optimized and all(".lora_A." in n or ".lora_B." in n for n in optimized)
    # 4 layers x 7 projections x (A, B)
    assert len(optimized) == 4 * 7 * 2
    base = {n: p.detach().clone() for n, p in t.engine.module.named_parameters()
            if not p.requires_grad}
    b = _batch()
    before = t.logprobs(b)
    b.behav_logp = before.clone()
    stats = t.train_step(b, None, LOSS)
    assert stats["grad_norm"] > 0
    delta = ((t.logprobs(b) - before) * b.loss_mask).sum(-1)
    assert delta[0] > 0 and delta[1] < 0, "the adapter moves likelihood along the advantage"
    # Adam's state exists for exactly the adapter's tensors, and no base weight changed
    state = t.optimizer.state_dict()["state"]
    assert len(state) == len(optimized)
    for n, p in t.engine.module.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base[n]), n


def test_the_reference_is_the_base_with_the_adapter_off(tiny_model_dir):
    t = _trainer(tiny_model_dir, keep_reference=True)
    plain = load_model(tiny_model_dir, "float32").eval()
    b = _batch(seed=2)
    for _ in range(2):
        _step(t, seed=2)
    ref = t.logprobs(b, t.reference)
    with torch.no_grad():
        out = plain(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
    want = torch.log_softmax(out[:, :-1].float(), -1).gather(-1, b.input_ids[:, 1:, None])[..., 0]
    assert torch.allclose(ref[:, 1:], want, atol=1e-5)
    assert not torch.allclose(t.logprobs(b)[:, 1:], want, atol=1e-3), "the policy has moved"
    # no second copy of the base: the reference is the trained module itself
    assert t.reference.peft_model is t.engine.module
    frozen = sum(p.numel() for p in t.engine.module.parameters() if not p.requires_grad)
    assert frozen == sum(p.numel() for p in plain.parameters())


def test_the_export_is_the_adapter_alone_in_peft_layout(tiny_model_dir, tmp_path):
    from peft import PeftModel

    t = _trainer(tiny_model_dir)
    _step(t, seed=4)
    folder = t.save_weights(tmp_path / "v1")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json",
                                                        "adapter_model.safetensors"]
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    state = load_file(str(folder / "adapter_model.safetensors"))
    assert state and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in state)
    # peft itself loads it onto the base and gives the trainer's logprobs
    loaded = PeftModel.from_pretrained(load_model(tiny_model_dir, "float32"), str(folder)).eval()
    b = _batch(seed=4)
    with torch.no_grad():
        out = loaded(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
    want = torch.log_softmax(out[:, :-1].float(), -1).gather(-1, b.input_ids[:, 1:, None])[..., 0]
    assert torch.allclose(t.logprobs(b)[:, 1:], want, atol=1e-5)


def test_resume_restores_the_adapter_and_its_optimizer_exactly(tiny_model_dir, tmp_path):
    """2 steps, checkpoint, a new trainer resumes and takes 2 more: the adapter and Adam's state
    equal an uninterrupted 4-step run's, bit for bit; the checkpoint holds no base weight."""
    whole = _trainer(tiny_model_dir)
    for seed in range(4):
        _step(whole, seed)
    first = _trainer(tiny_model_dir)
    for seed in range(2):
        _step(first, seed)
    path = first.save_checkpoint(tmp_path / "ckpt", "step2", {"step": 2})
    module_file = next(path.glob("mp_rank_*_model_states.pt"))
    saved = torch.load(module_file, map_location="cpu", weights_only=False)["module"]
    # DeepSpeed leaves out frozen parameters by name; a tied lm_head is no parameter of its own
    # (the embedding's alias), so it stays: the one base tensor in the file
    assert [k for k in saved if ".lora_A." not in k and ".lora_B." not in k] in (
        [], ["base_model.model.lm_head.weight"])
    torch.manual_seed(123)  # a fresh adapter that the checkpoint must replace
    resumed = DeepSpeedTrainer(tiny_model_dir, lr=1e-2, weight_decay=0.0, grad_clip=10.0,
                               zero_stage=0, micro_batch_tokens=20, lora=LoraSpec(rank=4, alpha=8))
    assert resumed.load_checkpoint(tmp_path / "ckpt", "step2")["step"] == 2
    for seed in range(2, 4):
        _step(resumed, seed)
    (w1, s1), (w2, s2) = _adapter_and_optimizer(whole), _adapter_and_optimizer(resumed)
    assert w1.keys() == w2.keys()
    for n in w1:
        assert torch.equal(w1[n], w2[n]), n
    assert len(s1) == len(s2) == len(w1)
    for a, b in zip(s1, s2, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])), k


def test_adapter_dropout_keeps_the_first_ratio_at_one(tiny_model_dir):
    t = DeepSpeedTrainer(tiny_model_dir, lr=1e-2, weight_decay=0.0, grad_clip=10.0, zero_stage=0,
                         lora=LoraSpec(rank=4, dropout=0.5))
    seen = {}

    def loss_fn(logp, prox, behav, *a, **k):
        seen.setdefault("prox", (prox.detach().clone(), behav.clone()))
        return LOSS(logp, prox, behav, *a, **k)

    b = _batch(seed=5)
    b.behav_logp = t.logprobs(b)
    t.train_step(b, None, loss_fn)
    # The proximal logprobs are the eval-mode policy's (no dropout), not the update's forward
    prox, behav = seen["prox"]
    assert torch.allclose(prox, behav, atol=1e-6)


def test_a_target_module_the_model_lacks_is_named(tiny_model_dir):
    with pytest.raises(ValueError, match=r"model.lora.target_modules: qkv_proj not in this model"):
        DeepSpeedTrainer(tiny_model_dir, lr=1e-2, weight_decay=0.0, grad_clip=10.0, zero_stage=0,
                         lora=LoraSpec(target_modules=["q_proj", "qkv_proj"]))


def test_zero_stages_one_and_two_give_the_same_adapter_update(tiny_model_dir):
    """ZeRO partitions the adapter's optimizer state, never the maths (stage 3 is refused by
    the spec)."""
    deltas = {}
    for stage in (0, 2):
        torch.manual_seed(0)
        t = DeepSpeedTrainer(tiny_model_dir, lr=1e-2, weight_decay=0.0, grad_clip=10.0,
                             zero_stage=stage, lora=LoraSpec(rank=4))
        b = _batch(seed=6)
        before = t.logprobs(b)
        b.behav_logp = before.clone()
        t.train_step(b, None, LOSS)
        deltas[stage] = ((t.logprobs(b) - before) * b.loss_mask).sum(-1)
    assert torch.allclose(deltas[0], deltas[2], atol=1e-4) and deltas[0].abs().sum() > 0
