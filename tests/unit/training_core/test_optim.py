"""The trainers' AdamW: fused where torch has the kernel, and the same update as the loop."""

from __future__ import annotations

import torch

from training_core.optim import adamw


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
