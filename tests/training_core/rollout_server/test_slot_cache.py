"""The embedded engine's slot cache: rows join, decode, leave and move, the window moves and the
buffers grow, and every decode step's logits stay those of a full forward over each row's
tokens."""

from __future__ import annotations

import pytest
import torch

from training_core.models.loading import load_model
from training_core.rollout_server import cpu_kernels, prefill, slot_cache
from training_core.rollout_server.fused_decode import FusedDecoder
from training_core.rollout_server.packed_linear import pack_linears
from training_core.rollout_server.prefill import forest_prefill
from training_core.rollout_server.slot_cache import ATTENTION, SlotCache


class Batch:
    """The engine's use of the cache, without threads or sampling: tokens are given."""

    def __init__(self, model, full_width: bool = False, kernel: bool = False):
        self.model, self.slots, self.rows, self.next_pos = model, None, [], None
        self.full_width = full_width
        # kernel: the fused decode step with cpu_kernels' attention (keys stored transposed)
        self.fused = FusedDecoder(model) if kernel else None
        assert not kernel or self.fused.uses_kernels

    @torch.no_grad()
    def join(self, prompts: list[list[int]]) -> torch.Tensor:
        # with the fused decoder, its prefill too (as the engine runs it)
        layers_kv, mask, logits = forest_prefill(self.model, prompts, torch.device("cpu"),
                                                 fused=self.fused)
        if self.slots is None:
            keys = layers_kv[0][0]
            self.slots = SlotCache(len(layers_kv), keys.shape[1], keys.shape[3], keys.dtype,
                                   torch.device("cpu"), full_width=self.full_width or self.fused is not None,
                                   keys_blocked=self.fused is not None)
        self.slots.join(layers_kv, mask, torch.arange(len(prompts)))
        pos = mask.sum(-1)
        self.next_pos = pos if self.next_pos is None else torch.cat([self.next_pos, pos])
        self.rows += [list(p) for p in prompts]
        return logits

    @torch.no_grad()
    def decode(self, tokens: list[int]) -> torch.Tensor:
        mask = self.slots.decode_mask()
        if self.fused is not None:
            logits = self.fused(torch.tensor(tokens), self.next_pos, mask, self.slots)
        else:
            logits = self.model(input_ids=torch.tensor(tokens).view(-1, 1), attention_mask=mask,
                                position_ids=self.next_pos.view(-1, 1),
                                past_key_values=self.slots, use_cache=True).logits[:, -1]
        self.slots.advance()
        self.next_pos = self.next_pos + 1
        for row, t in zip(self.rows, tokens, strict=True):
            row.append(t)
        return logits

    def keep(self, rows: list[int]) -> None:
        order = self.slots.keep(rows)
        self.rows = [self.rows[i] for i in order]
        self.next_pos = self.next_pos[torch.tensor(order)]


@torch.no_grad()
def _reference(reference_model, rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([reference_model(input_ids=torch.tensor([r])).logits[0, -1] for r in rows])


@pytest.mark.parametrize("full_width,kernel", [(False, False), (True, False), (True, True)],
                         ids=["window", "full-width", "kernel"])
def test_decoding_through_joins_moves_and_growth_matches_full_forwards(tiny_model_dir, monkeypatch,
                                                                       full_width, kernel):
    """Both ways decode attends: over the window (fp32), or over the buffers' whole width with
    the columns outside the window masked (reduced precision on CPU, see SlotCache); through
    transformers' forward, and through the fused step with cpu_kernels' attention (which writes
    the step's key and value into the cache itself, keys in blocks of columns, full width)."""
    if kernel and not cpu_kernels.load():
        pytest.skip("no C++ toolchain to build cpu_kernels with")
    monkeypatch.setattr(slot_cache, "LEFT_HEADROOM", 2)  # longer joiners must move the window
    # The window's buffers are uninitialised: filled with nan here, any column read before it
    # was written would turn the logits to nan. Full width zero-fills them (it reads them all).
    monkeypatch.setattr(slot_cache, "_uninitialized",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype))
    model = load_model(tiny_model_dir).eval()
    if kernel:
        pack_linears(model)
    model.config._attn_implementation = ATTENTION
    reference = load_model(tiny_model_dir).eval()
    g = torch.Generator().manual_seed(0)

    def toks(n: int) -> list[int]:
        return torch.randint(3, 60, (n,), generator=g).tolist()

    batch = Batch(model, full_width, kernel)
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


@pytest.mark.parametrize("fused", [False, True], ids=["transformers", "fused"])
def test_a_forest_prefill_shares_prefixes_and_splits_rows_and_matches_full_forwards(
        tiny_model_dir, monkeypatch, fused):
    """Samples resumed after a weight update: one prompt, answers with common starts, one answer
    a prefix of another, a second prompt; rows split (small budget), then decoding goes on.
    Through transformers' forward, and through the fused decoder's prefill and decode step."""
    if fused and not cpu_kernels.load():
        pytest.skip("no C++ toolchain to build cpu_kernels with")
    monkeypatch.setattr(prefill, "PREFILL_ROW_NODES", 16)
    model = load_model(tiny_model_dir).eval()
    if fused:
        pack_linears(model)
    model.config._attn_implementation = ATTENTION
    reference = load_model(tiny_model_dir).eval()
    prompt, other = [5, 9, 13, 7, 21, 4], [8, 8, 30]
    seqs = [prompt + [40, 41, 42], prompt + [40, 41, 50, 51], prompt + [40], prompt + [33, 34],
            other + [12, 12, 12, 12, 12], other + [12], prompt + [40, 41, 42, 43, 44, 45]]
    forest = prefill.prefill_forest(seqs, 16)
    assert forest.input_ids.shape[0] > 1, "the budget splits the forest into rows"
    assert int((forest.input_ids != 0).sum()) < sum(len(q) for q in seqs), "prefixes shared"

    batch = Batch(model, kernel=fused)
    logits = batch.join([list(q) for q in seqs])
    torch.testing.assert_close(logits, _reference(reference, seqs), atol=1e-4, rtol=1e-4)
    for step in range(5):
        logits = batch.decode([3 + step] * len(seqs))
        torch.testing.assert_close(logits, _reference(reference, batch.rows), atol=1e-4, rtol=1e-4,
                                   msg=lambda m, step=step: f"decode step {step}: {m}")


def test_a_forest_row_wider_than_a_block_of_queries_prefills_as_full_forwards(tiny_model_dir):
    """The fused prefill's attention by blocks of queries (fused_decode._attention_blocks) on a
    forest row several blocks wide: sixteen answers to one prompt, each its own branch. Its
    logits are transformers' full forwards', and so are the decode steps after it (the keys and
    values it gathered back into the cache)."""
    from training_core.rollout_server import fused_decode

    if not cpu_kernels.load():
        pytest.skip("no C++ toolchain to build cpu_kernels with")
    model = load_model(tiny_model_dir).eval()
    pack_linears(model)
    model.config._attn_implementation = ATTENTION
    reference = load_model(tiny_model_dir).eval()
    g = torch.Generator().manual_seed(3)
    prompt = [5, 9, 13, 7, 21, 4, 8]
    seqs = [prompt + torch.randint(3, 60, (int(n),), generator=g).tolist()
            for n in torch.randint(3, 9, (16,), generator=g)]
    forest = prefill.prefill_forest(seqs, prefill.PREFILL_ROW_NODES)
    assert forest.input_ids.shape[0] == 1, "one row"
    assert forest.input_ids.shape[1] > 2 * fused_decode.PREFILL_QUERY_BLOCK, "several blocks"
    batch = Batch(model, kernel=True)
    torch.testing.assert_close(batch.join([list(q) for q in seqs]), _reference(reference, seqs),
                               atol=1e-4, rtol=1e-4)
    for step in range(3):
        logits = batch.decode([3 + step] * len(seqs))
        torch.testing.assert_close(logits, _reference(reference, batch.rows), atol=1e-4, rtol=1e-4,
                                   msg=lambda m, step=step: f"decode step {step}: {m}")


def test_the_kernels_buffers_grow_by_half_and_serve_the_next_batch(monkeypatch):
    """cpu_kernels' attention reads a row's attended columns only, so its buffers grow by half
    what is needed (each reallocation pages in and copies the whole cache: 176 ms for SmolLM2
    at 64 rows) and a finished batch's buffers serve the next one without a reallocation,
    unless it is far narrower."""
    slots = SlotCache(2, 1, 16, torch.bfloat16, torch.device("cpu"), full_width=True,
                      keys_blocked=True)
    widths = []
    real = slots._allocate
    monkeypatch.setattr(slots, "_allocate",
                        lambda rows, cols: widths.append(cols) or real(rows=rows, cols=cols))
    kv = [(torch.zeros(1, 1, 5, 16, dtype=torch.bfloat16),
           torch.zeros(1, 1, 5, 16, dtype=torch.bfloat16))] * 2
    slots.join(kv, torch.ones(1, 5, dtype=torch.bool), torch.tensor([0]))
    widths.clear()
    for _ in range(400):
        slots.decode_mask()
        slots.advance()
    assert slots.valid.shape[1] >= 405
    assert len(widths) <= 4, widths  # by FULL_WIDTH_STEP it took eleven
    width = slots.valid.shape[1]
    slots.clear()
    widths.clear()
    long_prompt = [(torch.zeros(1, 1, 60, 16, dtype=torch.bfloat16),) * 2] * 2
    slots.join(long_prompt, torch.ones(1, 60, dtype=torch.bool), torch.tensor([0]))
    for _ in range(300):
        slots.decode_mask()
        slots.advance()
    assert widths == []
    # a batch far narrower than the buffers does not keep them all
    slots.clear()
    slots.join(kv, torch.ones(1, 5, dtype=torch.bool), torch.tensor([0]))
    slots.decode_mask()
    assert len(widths) == 1 and widths[0] < width / 4


def test_blocked_keys_take_a_first_join_wider_than_the_buffers():
    """The first join places the window past the first buffers (128 columns); the growth moves
    an empty window and the keys land, column by column, where the kernel reads them."""
    slots = SlotCache(2, 2, 16, torch.float32, torch.device("cpu"), keys_blocked=True)
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(3, 2, 200, 16, generator=g), torch.randn(3, 2, 200, 16, generator=g))
          for _ in range(2)]
    slots.join(kv, torch.ones(3, 200, dtype=torch.bool), torch.tensor([0, 1, 2]))
    blocks, values, column = slots.decode_buffers(1)
    assert blocks.shape[2] * 32 == values.shape[2] >= 201 and column == slots.hi
    by_column = blocks.transpose(-1, -2).reshape(3, 2, -1, 16)  # [rows, heads, columns, dim]
    torch.testing.assert_close(by_column[:, :, slots.lo: slots.hi], kv[1][0], atol=0, rtol=0)
    torch.testing.assert_close(values[:, :, slots.lo: slots.hi], kv[1][1], atol=0, rtol=0)
