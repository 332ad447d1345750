"""Load a model folder (training_core.models.paths resolves a spec's to one) into a model and
its tokenizer."""

from __future__ import annotations

from pathlib import Path

from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from training_core.dtypes import DEFAULT_DTYPE, precision, torch_dtype


def load_model(folder: str | Path, dtype: str = DEFAULT_DTYPE) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype(precision(dtype).name))
    model.config.use_cache = True
    return model


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(folder)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
