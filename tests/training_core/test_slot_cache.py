"""The embedded engine's slot cache: rows join, decode, leave and move, the window moves and the
buffers grow, and every decode step's logits stay those of a full forward over each row's
tokens."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from training_core.engines import slot_cache
from training_core.engines.slot_cache import ATTENTION, SlotCache, prefill_mask
from training_core.models.loading import load_model


class Batch:
    """The engine's use of the cache, without threads or sampling: tokens are given."""

    def __init__(self, model):
        self.model, self.slots, self.rows, self.next_pos = model, None, [], None

    @torch.no_grad()
    def join(self, prompts: list[list[int]]) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=prefill_mask(mask),
                         position_ids=(mask.cumsum(-1) - 1).clamp(min=0), past_key_values=cache,
                         use_cache=True)
        if self.slots is None:
            keys = cache.layers[0].keys
            self.slots = SlotCache(len(cache.layers), keys.shape[1], keys.shape[3], keys.dtype,
                                   torch.device("cpu"))
        self.slots.join([(c.keys, c.values) for c in cache.layers], mask,
                        torch.arange(len(prompts)))
        pos = mask.sum(-1)
        self.next_pos = pos if self.next_pos is None else torch.cat([self.next_pos, pos])
        self.rows += [list(p) for p in prompts]
        return out.logits[:, -1]

    @torch.no_grad()
    def decode(self, tokens: list[int]) -> torch.Tensor:
        mask = self.slots.decode_mask()
        out = self.model(input_ids=torch.tensor(tokens).view(-1, 1), attention_mask=mask,
                         position_ids=self.next_pos.view(-1, 1), past_key_values=self.slots,
                         use_cache=True)
        self.slots.advance()
        self.next_pos = self.next_pos + 1
        for row, t in zip(self.rows, tokens, strict=True):
            row.append(t)
        return out.logits[:, -1]

    def keep(self, rows: list[int]) -> None:
        order = self.slots.keep(rows)
        self.rows = [self.rows[i] for i in order]
        self.next_pos = self.next_pos[torch.tensor(order)]


@torch.no_grad()
def _reference(reference_model, rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([reference_model(input_ids=torch.tensor([r])).logits[0, -1] for r in rows])


def test_decoding_through_joins_moves_and_growth_matches_full_forwards(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(slot_cache, "LEFT_HEADROOM", 2)  # longer joiners must move the window
    model = load_model(tiny_model_dir).eval()
    model.config._attn_implementation = ATTENTION
    reference = load_model(tiny_model_dir).eval()
    g = torch.Generator().manual_seed(0)

    def toks(n: int) -> list[int]:
        return torch.randint(3, 60, (n,), generator=g).tolist()

    batch = Batch(model)
    batch.join([toks(4), toks(6), toks(4)])
    checked = 0
    for step in range(150):  # past the first 128 columns: the window moves and the buffers grow
        if step == 3:
            batch.join([toks(30), toks(2)])  # longer than the window and headroom together
        if step == 10:
            batch.join([toks(5) for _ in range(20)])  # more rows than the first buffers hold
        if step == 20:
            batch.keep([0, 2, 4, 7, 8, 9, 20, 24])  # holes filled from above, left padding trimmed
        if step == 40:
            batch.join([toks(9)])
        if step == 120:
            batch.keep([1, 3])
        logits = batch.decode(toks(len(batch.rows)))
        if step % 7 == 0 or step in (3, 10, 20, 21, 40, 120, 121, 149):
            torch.testing.assert_close(logits, _reference(reference, batch.rows), atol=1e-4,
                                       rtol=1e-4, msg=lambda m, step=step: f"step {step}: {m}")
            checked += 1
    assert checked > 25
    assert batch.slots.valid.shape[1] > 128 and batch.slots.valid.shape[0] > 16


def test_a_prefill_with_left_padding_keeps_every_position_finite():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    allowed = prefill_mask(mask)[:, 0]
    assert allowed.any(-1).all(), "every query position attends to something"
    assert not allowed[0, 2, :2].any(), "real tokens never attend to padding"
    assert allowed[1].equal(torch.ones(4, 4, dtype=torch.bool).tril())
