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

Twenty-odd calls per layer. On a CPU with AMX and a bf16 model, batches of 17 rows or more
decode on cpu_kernels' AMX projections instead (kernels/amx_linear.cpp): five calls per layer,
gate and up in one pass over x (their rows interleaved) with SiLU and the product in its
epilogue, the residual adds in the o and down projections', each weight read as one stream with
the next blocks fetched ahead. Bitwise what oneDNN's packed path gives (SiLU's exp may move an
output by one bf16 step); it keeps a third copy of the projection weights (packed for AMX).
SmolLM2's projections at 64 rows (an AMX Xeon, 2 threads, 30 layers as one step reads them):
14.4 against oneDNN's 16.6 ms, and a whole decode step 47.7 -> 39.3 ms. On an AVX-512 CPU
without AMX the AVX-512 kernel (kernels/avx512_linear.cpp) has the same calls and epilogues:
fp32 multiply-adds of the bf16 weights widened in registers. On a Xeon whose vdpbf16ps issues
at half an FMA's rate, where oneDNN's bf16 matmul ran no faster than fp32 (~150 GFLOPS on two
cores), the step's projections went 116-124 -> 72-74 ms at 64 rows, 41.6 -> 28 at 16, 17.3 ->
11.2 at one, and fp32's 89.6 -> 77.7 at 64 rows. On an AMD EPYC (Zen 4) vdpbf16ps issues as
fast as an FMA, so twice the products, and oneDNN's bf16 (on it) outran the widening kernel 2x
at 64 rows; there the kernel takes bf16 in vdpbf16ps's pairs of k instead (the CPU's two rates
are measured once per machine and recorded, cpu_kernels.recorded). On a CPU with AVX2 where that kernel is not built (no
AVX-512 with bf16 conversions, such as AMD's Zen 3) the AVX2
kernel (kernels/avx2_linear.cpp) does the same in passes of six rows by half a panel: SmolLM2's
fp32 projections 27.2 -> 21.6 ms at one row, 58 -> 44 at 16, 151 -> 130 at 64 (an AVX2 EPYC; a
bf16 model does not reach it there, since oneDNN cannot pack bf16 without AVX-512 and the
decoder needs its packed weights). Which of kernel and oneDNN is faster still depends on the
CPU and the batch, so the decoder times both on its own weights when it is made
(cpu_kernels.measured: a step's projections, lm_head's included, three times each per
calibration batch size, about a second for SmolLM2) and decodes on the kernel only at the batch
sizes where it took under 95% of oneDNN's time. That choice is made once per machine and model
shape and recorded (cpu_kernels.measured_once): every later server decodes on the same one.

Where the kernels make the whole step (attention, RMSNorm, and a projection kernel that serves
the batch), the layers run in one C++ call (cpu_kernels.decode_layers, kernels/decode_layers.cpp):
the same calls in the same order as the loop in :meth:`FusedDecoder.__call__`, bit for bit,
without 210 calls a step from Python (SmolLM2 at 64 rows on a Zen 5 EPYC: 30.0 -> 28.5 ms).

Prefill (several tokens per row) runs the same fused layers (:meth:`FusedDecoder.prefill`: oneDNN's
projections with these epilogues, SDPA's attention over the prefix forest by blocks of queries,
each over the columns it attends), so a sequence's first
token comes from the arithmetic of the ones after it. Every model this does not describe exactly
runs transformers' forward in both (:func:`supports`: Llama's layout, SiLU, no
biases, no sliding window), and any device without packed weights. The output is transformers'
up to rounding: the fused adds and products round once instead of twice, and the norm sums in
another order; the test holds it to transformers' logits and greedy tokens, before and after a
weight update (:meth:`FusedDecoder.refresh` must follow every weight change, as
``packed_linear.repack`` does).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from training_core.rollout_server import cpu_kernels
from training_core.rollout_server.packed_linear import PACK_ROWS_HINT, PackedLinear
from training_core.rollout_server.slot_cache import SlotCache, attention

log = logging.getLogger("oolong.server")
_linear = torch.ops.mkldnn._linear_pointwise
FUSED_DECODE_ENV = "OOLONG_FUSED_DECODE"  # "0": transformers' forward decodes (a kill switch)


def _shape_key(model: nn.Module) -> str:
    """What a projection timing depends on besides the machine: the weights' shapes and dtype."""
    cfg = model.config
    return (f"{next(model.parameters()).dtype}:{cfg.hidden_size}x{cfg.intermediate_size}"
            f":{cfg.num_hidden_layers}L:{cfg.num_attention_heads}/{cfg.num_key_value_heads}h"
            f":{cfg.vocab_size}v:{'tied' if getattr(cfg, 'tie_word_embeddings', False) else 'own'}")


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
        self.head_dim = head_dim(cfg)
        self.hidden = cfg.hidden_size
        self._qkv: list[torch.Tensor] = []
        # cpu_kernels' attention and norm where they are built; None: torch's operators
        first = next(model.parameters())
        self._attend = cpu_kernels.decode_attention(self.head_dim, first.device)
        self._rms_norm = cpu_kernels.rms_norm(first.device)
        # cpu_kernels' projections (AMX's or AVX-512's): each layer's (qkv, o, gate and up
        # interleaved, down) packed for them, and lm_head's; empty where none serves this model
        self._proj = cpu_kernels.projections(first.device, first.dtype)
        if self._proj is not None and not _kernel_fits(model):
            self._proj = None
        self._proj_layers: _PackedLayers | None = None
        self._proj_head: torch.Tensor | None = None
        # The layers in one call where the kernels make the whole step (decode_layers.cpp), with
        # the layers' norm weights (input, post-attention) as refresh() last found them
        self._layers_op = (cpu_kernels.decode_layers(first.device)
                           if self._attend is not None and self._rms_norm is not None
                           and _one_eps(model) else None)
        self._norm_weights: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.refresh()
        if self._proj is not None and self._proj.measure:
            kernel = self._proj.linear
            # once per machine and model shape, recorded: every server decodes on one choice
            self._proj = cpu_kernels.measured_once(
                self._proj, _shape_key(model), lambda rows: self._projections(rows, kernel),
                lambda rows: self._projections(rows, None))
            if self._proj is None:  # no copy of the weights kept for a kernel that never runs
                self._proj_layers, self._proj_head, self._norm_weights = None, None, None
        log.info("decode projections: %s", "oneDNN's" if self._proj is None else self._proj.describe())

    @property
    def uses_kernels(self) -> bool:
        """The attention kernel decodes: the slot cache must store keys in its blocks
        (SlotCache's ``keys_blocked``)."""
        return self._attend is not None

    def refresh(self) -> None:
        """Concatenate and pack q, k and v again from the (new) parameters, and the kernel's
        copies where one serves; the other projections reuse their own packed weights (repacked by
        ``packed_linear.repack``)."""
        layers = self.model.model.layers
        qkvs = [_qkv(layer).detach() for layer in layers]  # one concatenation for both packs
        self._qkv = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) for w in qkvs]
        if self._proj is not None:
            pack = self._proj.pack
            self._proj_layers = _PackedLayers(
                [pack(qkv) for qkv in qkvs],
                [pack(layer.self_attn.o_proj.weight.detach()) for layer in layers],
                [pack(_interleave(layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight))
                 for layer in layers],
                [pack(layer.mlp.down_proj.weight.detach()) for layer in layers])
            head = self.model.lm_head
            self._proj_head = pack(head.weight.detach()) if _kernel_head_fits(head) else None
        self._norm_weights = (
            [layer.input_layernorm.weight.detach() for layer in layers],
            [layer.post_attention_layernorm.weight.detach() for layer in layers],
        ) if self._proj is not None and self._layers_op is not None else None

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
        proj = self._proj.linear if self._proj is not None and self._proj.serves(b) else None
        if proj is not None and self._layers_op is not None:  # the same loop, in C++
            norms, post_norms = self._norm_weights
            key_blocks, values, column = slots.decode_stacks()
            layer = inner.layers[0]
            h = self._layers_op(h, norms, post_norms, layer.input_layernorm.variance_epsilon,
                                *self._proj_layers, self._proj.op, cos32, sin32, key_blocks, values,
                                bias, column, layer.self_attn.scaling, heads, kv)
            return self._head(self._norm(h, inner.norm), proj)
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = self._norm(h, layer.input_layernorm)
            qkv = self._qkv_proj(i, x, proj).view(b, heads + 2 * kv, dim)
            if self._attend is not None:  # the rotary embedding and the cache write included
                key_blocks, values, column = slots.decode_buffers(i)
                out = self._attend(qkv[:, :heads], qkv[:, heads: heads + kv],
                                   qkv[:, heads + kv:], cos32, sin32, key_blocks, values, bias, column,
                                   attn.scaling)
            else:
                qk = qkv[:, : heads + kv]
                qk = qk * cos + torch.roll(qk, half, dims=-1) * sin
                keys, values = slots.update(qk[:, heads:].unsqueeze(2),
                                            qkv[:, heads + kv:].unsqueeze(2), i)
                out, _ = attention(attn, qk[:, :heads].unsqueeze(2), keys, values, mask,
                                   scaling=attn.scaling)
            h = self._o_proj(i, out.reshape(b, heads * dim), h, proj)
            h = self._mlp(i, self._norm(h, layer.post_attention_layernorm), h, proj)
        return self._head(self._norm(h, inner.norm), proj)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                keep: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """transformers' forward over prefill rows, fused as a decode step is: input_ids and
        position_ids [R, C] (a prefix forest's nodes and depths), mask [R, 1, C, C] bool (True:
        attend) -> each layer's keys (rotated) and values [R, Hkv, C, D], and the logits at the
        columns ``keep`` [R * len(keep), vocab] (rows first).

        The projections are oneDNN's with the decode step's fused epilogues (at prefill sizes the
        AMX kernel's 32-row passes lost to oneDNN's blocking), the norm cpu_kernels'; attention is
        SDPA's, by blocks of queries over the columns they attend (:func:`_attention_blocks`).
        Against transformers' bf16 forward on SmolLM2 (64 prompts, 1,512 nodes; an AMX Xeon,
        before the blocks): 10-16% less time, and logits nearer the fp32 model's (mean KL 0.003
        against 0.026): the residual adds round once, in fp32. The first token then comes from
        the arithmetic of the ones after it."""
        if not isinstance(mask, torch.Tensor):  # a sliding window's dict: supports() excludes it
            raise TypeError("prefill takes a prepared [R, 1, C, C] boolean mask")
        inner = self.model.model
        rows, cols = input_ids.shape
        n, heads, kv, dim = rows * cols, self.heads, self.kv_heads, self.head_dim
        h = inner.embed_tokens(input_ids).view(n, self.hidden)
        cos, sin = inner.rotary_emb(h.view(rows, cols, -1), position_ids)  # [R, C, D]
        half = dim // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # rotate_half's sign
        cos, sin = cos.reshape(n, 1, dim), sin.reshape(n, 1, dim)
        layers_kv = []
        blocks = _attention_blocks(mask)
        for i, layer in enumerate(inner.layers):
            qkv = self._qkv_proj(i, self._norm(h, layer.input_layernorm), None).view(n, heads + 2 * kv, dim)
            qk = qkv[:, : heads + kv]
            qk = qk * cos + torch.roll(qk, half, dims=-1) * sin
            q = qk[:, :heads].view(rows, cols, heads, dim).transpose(1, 2)
            # copies: views would keep every layer's whole q/k/v buffers alive until the
            # forest's columns are gathered (4.5x the keys and values for SmolLM2's 9/3 heads)
            by_node = (qk[:, heads:].contiguous().view(rows, cols, kv, dim),
                       qkv[:, heads + kv:].contiguous().view(rows, cols, kv, dim))
            # a block's columns gathered as whole nodes (runs of kv * dim), its output put
            # back node by node: [R, C, H, D] is the o projection's input as it stands
            out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
                q[:, :, start: start + block.shape[2]],
                *(t.index_select(1, cols).transpose(1, 2) for t in by_node), attn_mask=block,
                scale=layer.self_attn.scaling, enable_gqa=kv != heads).transpose(1, 2)
                for start, cols, block in blocks], 1)
            keys, values = (t.transpose(1, 2) for t in by_node)
            h = self._o_proj(i, out.view(n, heads * dim), h, None)
            h = self._mlp(i, self._norm(h, layer.post_attention_layernorm), h, None)
            layers_kv.append((keys, values))
        last = h.view(rows, cols, self.hidden)[:, keep].reshape(-1, self.hidden)
        return layers_kv, self._head(self._norm(last, inner.norm), None)

    # A step's projections, on the kernel (``proj``: its linear) or on oneDNN's packed weights
    # (None); __call__ and the calibration's timing (_projections) both make them here.

    def _qkv_proj(self, i: int, x: torch.Tensor, proj: Callable | None) -> torch.Tensor:
        if proj is not None:
            return proj(x, self._proj_layers.qkv[i], None, "none")
        return _linear(x, self._qkv[i], None, "none", [], "")

    def _o_proj(self, i: int, out: torch.Tensor, h: torch.Tensor, proj: Callable | None
                ) -> torch.Tensor:
        """The attention's output projection with the residual added."""
        if proj is not None:
            return proj(out, self._proj_layers.o[i], h, "add")
        return _linear.binary(out, h, self.model.model.layers[i].self_attn.o_proj._packed, None, "add")

    def _mlp(self, i: int, x: torch.Tensor, h: torch.Tensor, proj: Callable | None) -> torch.Tensor:
        """down(SiLU(gate(x)) * up(x)) with the residual added."""
        if proj is not None:
            packed = self._proj_layers
            return proj(proj(x, packed.gate_up[i], None, "silu_mul"), packed.down[i], h, "add")
        mlp = self.model.model.layers[i].mlp
        gate = _linear(x, mlp.gate_proj._packed, None, "swish", [], "")
        up = _linear.binary(x, gate, mlp.up_proj._packed, None, "mul")
        return _linear.binary(up, h, mlp.down_proj._packed, None, "add")

    def _head(self, x: torch.Tensor, proj: Callable | None) -> torch.Tensor:
        if proj is not None and self._proj_head is not None:
            return proj(x, self._proj_head, None, "none")
        return self.model.lm_head(x)

    def _projections(self, rows: int, proj: Callable | None) -> None:
        """Every projection of a step at ``rows`` rows, as __call__ makes them (to time them):
        each weight comes from memory as in a step."""
        x, attn_out, h = self._calibration_inputs(rows)
        for i in range(len(self._qkv)):
            self._qkv_proj(i, x, proj)
            self._o_proj(i, attn_out, h, proj)
            self._mlp(i, x, h, proj)
        self._head(x, proj)

    def _calibration_inputs(self, rows: int) -> tuple[torch.Tensor, ...]:
        dtype = next(self.model.parameters()).dtype
        g = torch.Generator().manual_seed(rows)  # not the global generator: a caller's seed holds
        x = torch.randn(rows, self.hidden, generator=g).to(dtype)
        return x, torch.randn(rows, self.heads * self.head_dim, generator=g).to(dtype), x.clone()

    def _norm(self, h: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        if self._rms_norm is not None:
            return self._rms_norm(h, norm.weight, norm.variance_epsilon)
        normed = torch.rms_norm(h.float(), (self.hidden,), None, norm.variance_epsilon)
        return norm.weight * normed.to(h.dtype)


PREFILL_QUERY_BLOCK = 32


def _attention_blocks(mask: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """A prefill forest's attention in blocks of PREFILL_QUERY_BLOCK queries, each over only the
    columns some query of the block attends in some row: (first query, those columns, the mask
    [R, 1, block, columns]). A node attends its ancestors alone, so a forest row's mask is an eighth full (64
    prompts of SmolLM2's chat template, rows of 252 nodes); SDPA's flash kernel computes every
    column it is given, masked or not, and a block reads the shared prefix and its own branches
    (65-80 of 252 columns): a layer's attention 6.7 -> 2.9 ms, the same up to the order of
    flash attention's sums (one bf16 step)."""
    out = []
    for start in range(0, mask.shape[2], PREFILL_QUERY_BLOCK):
        rows = mask[:, :, start: start + PREFILL_QUERY_BLOCK]
        cols = rows.any(dim=(0, 1, 2)).nonzero().flatten()
        out.append((start, cols, rows.index_select(3, cols)))
    return out


class _PackedLayers(NamedTuple):
    """Every layer's projections packed for the decoder's kernel, one list per kind (the order
    decode_layers takes them in)."""

    qkv: list[torch.Tensor]
    o: list[torch.Tensor]
    gate_up: list[torch.Tensor]  # gate and up interleaved (_interleave)
    down: list[torch.Tensor]


def _one_eps(model: nn.Module) -> bool:
    """Every layer's norms with one epsilon and every attention with one scaling: what
    decode_layers takes once for all of them."""
    layers = model.model.layers
    eps = {n.variance_epsilon for layer in layers
           for n in (layer.input_layernorm, layer.post_attention_layernorm)}
    return len(eps) == 1 and len({layer.self_attn.scaling for layer in layers}) == 1


def _qkv(layer: nn.Module) -> torch.Tensor:
    a = layer.self_attn
    return torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Rows of gate and up alternating in blocks of 16: the kernels' panels of 32 columns then
    hold a gate and its up projection side by side (their "silu_mul" epilogue)."""
    rows, width = gate.shape
    return torch.stack([gate.detach().reshape(rows // 16, 16, width),
                        up.detach().reshape(rows // 16, 16, width)], 1).reshape(2 * rows, width)


def head_dim(config) -> int:
    """An attention head's width: the config's own where it sets one, else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _kernel_fits(model: nn.Module) -> bool:
    """The projection kernels' shapes for the layers: every projection's sizes multiples of 32 (gate and
    up interleave in blocks of 16, so twice the intermediate size)."""
    cfg = model.config
    heads, kv, dim = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
    sizes = (cfg.hidden_size, (heads + 2 * kv) * dim, heads * dim, cfg.intermediate_size)
    return all(n % 32 == 0 for n in sizes)


def _kernel_head_fits(head: nn.Module) -> bool:
    """lm_head on the projection kernel too: no bias, both sizes multiples of 32 (else oneDNN's)."""
    rows, width = head.weight.shape
    return getattr(head, "bias", None) is None and rows % 32 == 0 and width % 32 == 0
