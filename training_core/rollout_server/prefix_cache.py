"""Keys and values of finished requests, kept for the next request that starts with them: an
agent's next turn (its last prompt, the answer, the new messages) prefills only the new tokens,
as SGLang's radix cache makes it.

What is kept: a request that finished (not aborted) leaves its prompt and output minus the last
token (the one no decode step has fed yet), as per-layer keys and values copied out of the slot
cache. Entries are evicted least recently used first, within ``max_bytes``; they are dropped on
any weight update (keys computed by other weights are not this policy's) and on
``/flush_cache``. A hit must leave at least one token to compute (the one whose logits are
sampled).

A joining batch is prefilled in two parts: sequences with a hit run the model over their new
tokens only, with the cached prefix as past; the others go through the prefix forest as before
(prefill.forest_prefill). Both come back in the layout :meth:`SlotCache.join` takes (left-padded
to one width), so the engine joins them as one batch.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from training_core.prefix_tree import layer_masks
from training_core.rollout_server.fused_decode import FusedDecoder
from training_core.rollout_server.prefill import forest_prefill

PREFIX_CACHE_ENV = "OOLONG_PREFIX_CACHE_MB"  # the budget; 0 turns the cache off
DEFAULT_MB = 512
MIN_TOKENS = 16  # shorter sequences are cheaper to prefill than to keep and look up
KEY_TOKENS = 16  # entries are found by their first tokens


@dataclass
class Entry:
    tokens: tuple[int, ...]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [Hkv, L, D]
    nbytes: int


class PrefixCache:
    def __init__(self, max_bytes: int | None = None):
        if max_bytes is None:
            max_bytes = int(float(os.environ.get(PREFIX_CACHE_ENV, DEFAULT_MB)) * 2**20)
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.by_key: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
        self.bytes = 0
        self.hits = 0
        self.cached_tokens = 0  # prompt tokens served from the cache (not computed)
        self.computed_tokens = 0  # prompt tokens the prefill computed

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def clear(self) -> None:
        self.entries.clear()
        self.by_key.clear()
        self.bytes = 0

    def store(self, tokens: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not self.enabled or len(tokens) < MIN_TOKENS:
            return
        key = tuple(tokens)
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if nbytes > self.max_bytes:
            return
        self._drop(key)
        self.entries[key] = Entry(key, kv, nbytes)
        self.by_key.setdefault(key[:KEY_TOKENS], set()).add(key)
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.nbytes
            same = self.by_key.get(key[:KEY_TOKENS])
            if same is not None:
                same.discard(key)
                if not same:
                    del self.by_key[key[:KEY_TOKENS]]

    def lookup(self, tokens: list[int]) -> Entry | None:
        """The longest entry that is a proper prefix of ``tokens``."""
        if not self.enabled or len(tokens) <= MIN_TOKENS:
            return None
        best = None
        for key in self.by_key.get(tuple(tokens[:KEY_TOKENS]), ()):
            if len(key) < len(tokens) and (best is None or len(key) > len(best)) \
                    and tuple(tokens[: len(key)]) == key:
                best = key
        if best is None:
            return None
        self.entries.move_to_end(best)
        return self.entries[best]


def row_kv(slots, row: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The last ``n`` columns of ``row`` of the slot cache (a row's tokens end at ``hi``), per
    layer, as copies [Hkv, n, D]."""
    cols = slice(slots.hi - n, slots.hi)
    return [(slots.keys[layer, row, :, cols].clone(), slots.values[layer, row, :, cols].clone())
            for layer in range(slots.shape[0])]


def _cached_prefill(model: torch.nn.Module, entry: Entry, tokens: list[int],
                    device: torch.device) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                                   torch.Tensor]:
    """Keys and values of all of ``tokens`` ([1, Hkv, L, D] per layer) and the logits after the
    last, computing only the tokens past ``entry``."""
    cache = DynamicCache()
    for layer, (k, v) in enumerate(entry.kv):
        cache.update(k.unsqueeze(0).to(device), v.unsqueeze(0).to(device), layer)
    start = len(entry.tokens)
    new = torch.tensor([tokens[start:]], device=device)
    positions = torch.arange(start, len(tokens), device=device).view(1, -1)
    # A prepared mask, as the engine's attention takes (prefix_tree.layer_masks): query i (at
    # start + i) sees every key up to itself.
    keys = torch.arange(len(tokens), device=device).view(1, 1, 1, -1)
    distance = positions.view(1, 1, -1, 1) - keys
    mask = layer_masks(model.config, distance >= 0, distance)
    out = model(input_ids=new, position_ids=positions, past_key_values=cache, use_cache=True,
                attention_mask=mask, logits_to_keep=1)
    return [(layer.keys, layer.values) for layer in cache.layers], out.logits[:, -1, :]


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """[U, Hkv, P, D] -> [U, Hkv, width, D], zeros on the left."""
    if t.shape[2] == width:
        return t
    pad = t.new_zeros(t.shape[0], t.shape[1], width - t.shape[2], t.shape[3])
    return torch.cat([pad, t], dim=2)


def prefill(model: torch.nn.Module, seqs: list[tuple[int, ...]], device: torch.device,
            fused: FusedDecoder | None, cache: PrefixCache | None
            ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
    """:func:`prefill.forest_prefill`'s result for ``seqs``, the cached ones computing only
    their new tokens (module doc)."""
    hits = {i: e for i, s in enumerate(seqs) if cache is not None
            and (e := cache.lookup(list(s))) is not None}
    if not hits:
        if cache is not None:
            cache.computed_tokens += sum(len(s) for s in seqs)
        return forest_prefill(model, [list(s) for s in seqs], device, fused=fused)
    parts: dict[int, tuple[list, torch.Tensor, torch.Tensor]] = {}
    misses = [i for i in range(len(seqs)) if i not in hits]
    if misses:
        kv, mask, logits = forest_prefill(model, [list(seqs[i]) for i in misses], device,
                                          fused=fused)
        for j, i in enumerate(misses):
            parts[i] = ([(k[j: j + 1], v[j: j + 1]) for k, v in kv], mask[j: j + 1],
                        logits[j: j + 1])
    for i, entry in hits.items():
        kv, logits = _cached_prefill(model, entry, list(seqs[i]), device)
        parts[i] = (kv, torch.ones(1, len(seqs[i]), dtype=torch.long, device=device), logits)
        cache.hits += 1
        cache.cached_tokens += len(entry.tokens)
    cache.computed_tokens += sum(len(seqs[i]) for i in misses) + sum(
        len(seqs[i]) - len(e.tokens) for i, e in hits.items())
    width = max(p[1].shape[1] for p in parts.values())
    order = [parts[i] for i in range(len(seqs))]
    layers = len(order[0][0])
    layers_kv = [(torch.cat([_left_pad(p[0][layer][0], width) for p in order]),
                  torch.cat([_left_pad(p[0][layer][1], width) for p in order]))
                 for layer in range(layers)]
    mask = torch.cat([torch.cat([p[1].new_zeros(1, width - p[1].shape[1]), p[1].long()], dim=1)
                      for p in order])
    dtype = order[0][2].dtype
    logits = torch.cat([p[2].to(dtype) for p in order])
    return layers_kv, mask, logits
