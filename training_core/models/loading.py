"""Load a model folder (training_core.models.paths resolves a spec's to one) into a model and
its tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(folder: str | Path, dtype: str = "float32") -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype])
    model.config.use_cache = True
    return model


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(folder)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
