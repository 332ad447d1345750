"""Sliding-window models (Mistral-shaped: every layer; Qwen2-shaped: some layers) give the
numbers of a plain transformers forward through the trainer's prefix forest and the embedded
engine's prefill and decode, whose prepared masks transformers would otherwise use as they are
(no window at all)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.training_core.rollout_server.test_generation_engine import _run
from tests.training_core.test_prefix_tree import _batch, _rows
from training_core.models.loading import load_model
from training_core.models.tiny import build_char_tokenizer, build_tiny_model
from training_core.prefix_tree import (
    prefix_tree_logprobs,
    sequence_logprobs,
    shares_prefixes,
    sliding_window,
)
from training_core.rollout_server.generation_engine import GenerationEngine

WINDOW = 4
FAMILIES = {"mistral": {"family": "mistral"},
            "qwen2_mixed": {"family": "qwen2", "full_attention_layers": 1}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def windowed_dir(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(request.param)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=3, num_heads=4,
                             sliding_window=WINDOW, **FAMILIES[request.param])
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _plain(model_dir: Path, ids: torch.Tensor, *, window: bool = True) -> torch.Tensor:
    """transformers' own forward (its sliding-window mask from a 2D padding mask)."""
    model = load_model(model_dir).eval()
    if not window:
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = ["full_attention"] * len(model.config.layer_types)
        else:
            model.config.sliding_window = None
    with torch.no_grad():
        return sequence_logprobs(model, ids, torch.ones_like(ids), 1.0)


def test_the_window_changes_the_numbers_so_the_tests_below_can_fail(windowed_dir):
    ids = torch.randint(3, 60, (1, 16), generator=torch.Generator().manual_seed(0))
    assert sliding_window(load_model(windowed_dir).config) == WINDOW
    gap = (_plain(windowed_dir, ids) - _plain(windowed_dir, ids, window=False)).abs().max()
    assert gap > 1e-2


def test_the_trainers_prefix_forest_honours_the_window(windowed_dir):
    batch = _batch(_rows())  # prompts and answers longer than the window, shared prefixes
    model = load_model(windowed_dir).eval()
    assert shares_prefixes(model.config)
    with torch.no_grad():
        shared = prefix_tree_logprobs(model, batch.input_ids, batch.attention_mask,
                                      batch.versions, 1.0)
        whole = sequence_logprobs(model, batch.input_ids, batch.attention_mask, 1.0)
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(shared[mask], whole[mask], atol=1e-5, rtol=1e-5)


def test_the_engines_prefill_and_decode_honour_the_window(windowed_dir):
    engine = GenerationEngine(str(windowed_dir), seed=5)
    try:
        # A group sharing a prompt longer than the window, and one joining later (another
        # prefill into a running batch), each decoding well past the window.
        prompts = [[7, 8, 9, 10, 11, 12, 13]] * 4 + [[20, 21, 22]]
        outs = _run(engine, prompts, max_new_tokens=14, gap_s=0.01)
    finally:
        engine.shutdown()
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt + out["output_ids"]])
        ref = _plain(windowed_dir, ids)[0, len(prompt):]
        got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
