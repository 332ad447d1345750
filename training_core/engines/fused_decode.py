"""The embedded engine's decode step for Llama-family models on CPU, with fused oneDNN kernels.

A decode step at a small batch is paid in operator calls, not in FLOPs: transformers' Llama
layer issues about 55 of them per layer for one new token per row (RMSNorm alone is eight:
casts, power, mean, rsqrt and two products; rotary embedding about a dozen), so a SmolLM2 step at
16 rows spent about three quarters of its time outside the matmuls. SGLang's own model code
fuses what can be fused (``QKVParallelLinear``, ``MergedColumnParallelLinear``, fused norms);
this does the same with the kernels this CPU build has:

- q, k and v in one packed matmul (their weights concatenated);
- the rotary embedding of q and k at once, with the sign of ``rotate_half`` moved into the sine
  (computed once per step for every layer): ``x * cos + roll(x) * sin'``;
- RMSNorm as ``torch.rms_norm`` over the float32 hidden state, then the weight, as transformers
  orders it;
- the gate projection with SiLU fused into its matmul, the up projection with the product fused
  into its matmul, and the o and down projections with the residual add fused into theirs.

Twenty-odd calls per layer. Prefill (several tokens per row) stays with transformers' forward;
so does every model this does not describe exactly (:func:`supports`: Llama's layout, SiLU, no
biases, no sliding window), and any device without packed weights. The output is transformers'
up to rounding: the fused adds and products round once instead of twice, and the norm sums in
another order; the test holds it to transformers' logits and greedy tokens, before and after a
weight update (:meth:`FusedDecoder.refresh` must follow every weight change, as
``packed_linear.repack`` does).
"""

from __future__ import annotations

import torch
from torch import nn

from training_core.engines import cpu_kernels
from training_core.engines.packed_linear import PACK_ROWS_HINT, PackedLinear
from training_core.engines.slot_cache import SlotCache, attention

_linear = torch.ops.mkldnn._linear_pointwise
FUSED_DECODE_ENV = "OOLONG_FUSED_DECODE"  # "0": transformers' forward decodes (a kill switch)


def supports(model: nn.Module) -> bool:
    """A Llama-family model whose decode step this module computes exactly as transformers
    does, with its linear layers packed (packed_linear.py)."""
    cfg = model.config
    inner = getattr(model, "model", None)
    if type(model).__name__ != "LlamaForCausalLM" or inner is None:
        return False
    if (getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "attention_bias", False)
            or getattr(cfg, "mlp_bias", False) or getattr(cfg, "pretraining_tp", 1) != 1
            or getattr(cfg, "sliding_window", None)):
        return False
    layers = list(inner.layers)
    return bool(layers) and all(
        isinstance(m, PackedLinear)
        for layer in layers for m in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                      layer.self_attn.v_proj, layer.self_attn.o_proj,
                                      layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj))


class FusedDecoder:
    """One decode step of ``model`` (see the module docstring); ``supports(model)`` first."""

    def __init__(self, model: nn.Module):
        cfg = model.config
        self.model = model
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.hidden = cfg.hidden_size
        self._qkv: list[torch.Tensor] = []
        # cpu_kernels' attention and norm where they are built; None: torch's operators
        device = next(model.parameters()).device
        self._attend = cpu_kernels.decode_attention(self.head_dim, device)
        self._rms_norm = cpu_kernels.rms_norm(device)
        self.refresh()

    @property
    def uses_kernels(self) -> bool:
        """The attention kernel decodes: the slot cache must store keys transposed
        (SlotCache's ``keys_transposed``)."""
        return self._attend is not None

    def refresh(self) -> None:
        """Concatenate and pack q, k and v again from the (new) parameters; the other
        projections reuse their own packed weights (repacked by ``packed_linear.repack``)."""
        self._qkv = [torch.ops.mkldnn._reorder_linear_weight(
            torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),
            PACK_ROWS_HINT) for a in (layer.self_attn for layer in self.model.model.layers)]

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                 slots: SlotCache) -> torch.Tensor:
        """input_ids, position_ids [B] (one new token per row), mask [B, 1, 1, L] (the slot
        cache's decode mask) -> logits [B, vocab]. Writes each layer's keys and values into
        ``slots`` as transformers' forward would."""
        inner = self.model.model
        b, heads, kv, dim = input_ids.shape[0], self.heads, self.kv_heads, self.head_dim
        h = inner.embed_tokens(input_ids)  # [B, hidden]
        cos, sin = inner.rotary_emb(h.unsqueeze(1), position_ids.view(b, 1))  # [B, 1, D]
        half = dim // 2
        # rotate_half(x) * sin == roll(x, half) * sin' with the first half of sin negated
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        if self._attend is not None:  # once for every layer: the mask as a bias, cos and sin
            bias = torch.zeros(mask.shape[0], mask.shape[-1], dtype=torch.float32)
            bias.masked_fill_(~mask.view(b, -1), float("-inf"))
            cos32, sin32 = cos.reshape(b, dim).float(), sin.reshape(b, dim).float()
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = self._norm(h, layer.input_layernorm)
            qkv = _linear(x, self._qkv[i], None, "none", [], "").view(b, heads + 2 * kv, dim)
            if self._attend is not None:  # the rotary embedding and the cache write included
                keys_t, values, column = slots.decode_buffers(i)
                out = self._attend(qkv[:, :heads], qkv[:, heads: heads + kv],
                                   qkv[:, heads + kv:], cos32, sin32, keys_t, values, bias, column,
                                   attn.scaling)
            else:
                qk = qkv[:, : heads + kv]
                qk = qk * cos + torch.roll(qk, half, dims=-1) * sin
                keys, values = slots.update(qk[:, heads:].unsqueeze(2),
                                            qkv[:, heads + kv:].unsqueeze(2), i)
                out, _ = attention(attn, qk[:, :heads].unsqueeze(2), keys, values, mask,
                                   scaling=attn.scaling)
            h = _linear.binary(out.reshape(b, heads * dim), h, attn.o_proj._packed, None, "add")
            x = self._norm(h, layer.post_attention_layernorm)
            gate = _linear(x, mlp.gate_proj._packed, None, "swish", [], "")
            up = _linear.binary(x, gate, mlp.up_proj._packed, None, "mul")
            h = _linear.binary(up, h, mlp.down_proj._packed, None, "add")
        return self.model.lm_head(self._norm(h, inner.norm))

    def _norm(self, h: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        if self._rms_norm is not None:
            return self._rms_norm(h, norm.weight, norm.variance_epsilon)
        normed = torch.rms_norm(h.float(), (self.hidden,), None, norm.variance_epsilon)
        return norm.weight * normed.to(h.dtype)
