"""The engine's linear layers with their weights prepacked for oneDNN (CPU).

``F.linear`` on CPU hands a plain row-major weight to its kernel, which brings it into a blocked
layout on every call: at a decode step's few rows that is a second pass over every weight.
Packed once, a SmolLM2 MLP projection (1536 x 576, 2 threads, an AVX512-BF16 EPYC) took in bf16
128 us instead of 238 at 16 rows and 349 instead of 459 at 64, bitwise the same output; in fp32
533 instead of 715 at 16 rows and 11.1 instead of 16.8 ms at 1024 (a prefill), summed in another
order. The engine's fp32 logprobs stay as close to the trainer's as before (SmolLM2, 256 sampled
tokens: mean / max difference 7.9e-6 / 7.7e-5 nats, unpacked 6.7e-6 / 2.3e-5; bf16 differs by
0.03 / 0.2). SmolLM2's engine at batch 64: fp32 207 -> 275 tok/s. GPUs have nothing to pack.

The layers stay ``nn.Linear`` (state dicts, weight loading and embedding tying see the same
parameters); :func:`repack` must follow every change of their weights.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("oolong.server")

# The row count oneDNN's packed layout is chosen for; any row count runs on it. 16 was as fast
# as 64 and 256 at 16-200 rows, and faster at 4.
PACK_ROWS_HINT = 16


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward runs on a packed copy of its weight."""

    _packed: torch.Tensor

    def repack(self) -> None:
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(),
                                                               PACK_ROWS_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, self.bias,
                                                  "none", [], "")


def can_pack(model: nn.Module, device: torch.device) -> bool:
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and next(model.parameters()).dtype in (torch.bfloat16, torch.float32))


def pack_linears(model: nn.Module) -> int:
    """Turn every ``nn.Linear`` of ``model`` into a :class:`PackedLinear` (in place). Returns how
    many; 0 where this torch build cannot pack (logged, the model unchanged)."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    try:
        for m in linears:
            m.__class__ = PackedLinear
            m.repack()
    except (RuntimeError, AttributeError) as exc:  # a build without the oneDNN ops
        for m in linears:
            m.__class__ = nn.Linear
            m.__dict__.pop("_packed", None)
        log.warning("linear weights not prepacked: %s", exc)
        return 0
    return len(linears)


def repack(model: nn.Module) -> None:
    """Pack the (new) weights again after they were loaded or re-tied."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.repack()
