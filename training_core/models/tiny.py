"""A tiny Llama built from config plus a character-level tokenizer trained locally.

For the CPU demo and CI: no hub, builds in a second, and learns simple arithmetic quickly.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

SPECIALS = ["<pad>", "<s>", "</s>"]
ALPHABET = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"] + ["\n"]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + ALPHABET)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    # Every character is its own token.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="?"
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    max_positions: int = 512,
    seed: int = 0,
    family: str = "llama",
    sliding_window: int | None = None,
    full_attention_layers: int = 0,
) -> PreTrainedModel:
    """A tiny causal LM. ``family``: llama (the demo's), mistral (every layer attends within
    ``sliding_window``) or qwen2 (the first ``full_attention_layers`` layers attend to
    everything, the others within ``sliding_window``): the shapes the engine's masks must get
    right."""
    torch.manual_seed(seed)
    config_class, model_class, extra = {
        "llama": (LlamaConfig, LlamaForCausalLM, {}),
        "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": sliding_window}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {
            "sliding_window": sliding_window, "use_sliding_window": sliding_window is not None,
            "max_window_layers": full_attention_layers}),
    }[family]
    config = config_class(
        **extra,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    return model_class(config)


def save_tiny(out_dir: str | Path, **kwargs: object) -> Path:
    """Write a fresh tiny model + tokenizer as a normal Hugging Face folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, **kwargs)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
