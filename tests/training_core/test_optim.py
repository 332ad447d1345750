"""The trainers' AdamW: fused where torch has the kernel, and the same update as the loop."""

from __future__ import annotations

import copy

import pytest
import torch

from training_core.optim import adamw, keep_fused

pytestmark = pytest.mark.unit  # no process, network or database (conftest)


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in [(37, 19), (19,), (5,)]]


def test_cpu_parameters_get_the_fused_kernel_and_the_same_steps_as_the_per_tensor_loop():
    fused, loop = _params(0), _params(0)
    opt = adamw(fused, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999))
    ref = torch.optim.AdamW(loop, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999), foreach=False)
    assert opt.param_groups[0]["fused"] is True
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for a, b in zip(fused, loop, strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    for a, b, start in zip(fused, loop, _params(0), strict=True):
        assert not torch.equal(a.detach(), start.detach())  # it moved
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_parameters_without_a_fused_kernel_keep_the_plain_optimizer():
    params = [torch.nn.Parameter(torch.randn(4).to(torch.complex64))]
    opt = adamw(params, lr=1e-3)
    assert not opt.param_groups[0]["fused"]
    params[0].grad = torch.ones_like(params[0])
    opt.step()


def test_a_state_saved_by_an_unfused_optimizer_does_not_turn_fusing_off():
    """``load_state_dict`` takes the saved groups whole (``fused: None``): a run resumed from a
    checkpoint of an older version would lose the fused kernel without ``keep_fused``."""
    old = _params(0)
    unfused = torch.optim.AdamW(old, lr=1e-2, foreach=False)
    for p in old:
        p.grad = torch.ones_like(p)
    unfused.step()
    fused_params, loop_params = _params(0), _params(0)
    for target in (fused_params, loop_params):
        for p, o in zip(target, old, strict=True):
            p.data.copy_(o.detach())
    opt = adamw(fused_params, lr=1e-2)
    opt.load_state_dict(copy.deepcopy(unfused.state_dict()))  # loading shares the tensors
    assert not opt.param_groups[0]["fused"]  # what torch does
    keep_fused(opt)
    assert opt.param_groups[0]["fused"] is True
    ref = torch.optim.AdamW(loop_params, lr=1e-2, foreach=False)
    ref.load_state_dict(copy.deepcopy(unfused.state_dict()))
    for p, q in zip(fused_params, loop_params, strict=True):
        p.grad, q.grad = torch.full_like(p, 0.5), torch.full_like(q, 0.5)
    opt.step()
    ref.step()
    for p, q in zip(fused_params, loop_params, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
