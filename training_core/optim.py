"""The optimizer every trainer in the package uses."""

from __future__ import annotations

from collections.abc import Iterable

import torch

FUSED_DEVICES = ("cpu", "cuda")


def adamw(params: Iterable[torch.nn.Parameter], **kwargs: object) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` in its fused form where torch has one for the parameters' device
    (CPU and CUDA since torch 2.4): one vectorised pass per tensor instead of about ten
    element-wise ops, each a pass over the tensor. torch picks the per-tensor loop on CPU by
    default; on SmolLM2's 135M parameters on one thread a step took 0.52 s that way and 0.08 s
    fused (the moments and the update are the same arithmetic, in the same precision)."""
    params = list(params)
    # torch checks this only at the first step, where a refusal would stop a run.
    fused = all(torch.is_floating_point(p) and p.device.type in FUSED_DEVICES for p in params)
    return torch.optim.AdamW(params, fused=fused or None, **kwargs)  # type: ignore[arg-type]
