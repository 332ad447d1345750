"""A joining group's prefill on a prefix forest: every distinct prefix computed once.

The joining sequences are laid out as a prefix forest (``prefix_tree.prefill_forest``), run
through the model once (the fused decoder's prefill, or transformers' forward), and each
sequence's keys and values are gathered from its nodes in the layout :meth:`SlotCache.join`
takes. It sits beside the cache and the decoder rather than in either: it uses both.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from training_core.prefix_tree import layer_masks, prefill_forest
from training_core.rollout_server.fused_decode import FusedDecoder

# Nodes per row of a prefill forest: attention over a row costs its width squared, the linear
# layers its node count, so rows of a few hundred nodes keep attention a small share.
PREFILL_ROW_NODES = 256


def forest_prefill(model: torch.nn.Module, seqs: list[list[int]], device: torch.device,
                   fused: FusedDecoder | None = None
                   ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
    """Prefill ``seqs`` on a prefix forest (``prefix_tree.prefill_forest``): every distinct
    prefix once, no padding computed. Returns each layer's keys and values per sequence,
    left-padded ([U, Hkv, P, D], what :meth:`SlotCache.join` takes), the mask [U, P] and the
    logits after each sequence's last token [U, V]. With ``fused`` (the engine's decoder for
    ``model``) the forward is its :meth:`~FusedDecoder.prefill`, else transformers'."""
    forest = prefill_forest(seqs, PREFILL_ROW_NODES)
    depths = forest.position_ids.to(device)
    rows = len(depths)
    masks = layer_masks(model.config, forest.allowed.to(device),
                        depths.view(rows, 1, -1, 1) - depths.view(rows, 1, 1, -1))
    # Logits only where a sequence ends (the columns holding some row's last node): over every
    # node, the vocabulary projection of a batch of 64 forty-token prompts was 145 GFLOP and a
    # 500 MB tensor, for 64 rows of it.
    cols = forest.input_ids.shape[1]
    last = forest.last.to(device)
    keep = torch.unique(last % cols)  # sorted
    if fused is not None:
        computed, kept_logits = fused.prefill(forest.input_ids.to(device), depths, masks, keep)
    else:
        cache = DynamicCache()
        out = model(input_ids=forest.input_ids.to(device), attention_mask=masks,
                    position_ids=depths, past_key_values=cache, use_cache=True, logits_to_keep=keep)
        computed = [(layer.keys, layer.values) for layer in cache.layers]
        kept_logits = out.logits.reshape(-1, out.logits.shape[-1])
    nodes = forest.nodes.to(device)
    units, width = nodes.shape

    def columns(t: torch.Tensor) -> torch.Tensor:  # [R, Hkv, W, D] -> [U, Hkv, P, D]
        flat = t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])
        return flat.index_select(0, nodes.view(-1)).view(units, width, *flat.shape[1:]).transpose(1, 2)

    layers_kv = [(columns(keys), columns(values)) for keys, values in computed]
    kept = (last // cols) * len(keep) + torch.searchsorted(keep, last % cols)  # in [R, C]
    logits = kept_logits.index_select(0, kept)
    return layers_kv, forest.mask.to(device), logits

