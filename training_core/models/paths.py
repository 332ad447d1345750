"""Where a run's model lives: the spec's ``model.path`` resolved to a Hugging Face folder.

Light on purpose (no torch, no transformers at import): the processes that only place or
supervise a run (Prefect's node flows, the coordinating flow, the web app) need the folder, not
the model, and importing transformers cost every such process 6-9 s of start-up on a 2-core
machine. The tiny model is built and SmolLM2 converted on first use, which imports them then.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from training_core.cache import cache_root
from training_core.models.smollm2 import ensure_smollm2

# The models Oolong builds itself, by the name ``model.path`` gives them: the only ones a project
# member may train (webapp/runs/policy.py reads this list; administrators may name a folder).
TINY, SMOLLM2 = "tiny", "smollm2"
REGISTERED_MODELS = (TINY, SMOLLM2)


def resolve_model_dir(path: str, *, hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4) -> Path:
    """``tiny`` -> a cached fresh tiny model; ``smollm2`` -> converted GGUF; else a local folder."""
    if path == TINY:
        key = hashlib.sha1(json.dumps([hidden_size, num_layers, num_heads]).encode()).hexdigest()[:10]
        out = cache_root() / "models" / f"tiny-{key}"
        if not (out / "config.json").exists():
            from training_core.models.tiny import save_tiny

            tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            save_tiny(tmp, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads)
            try:
                tmp.rename(out)
            except OSError:  # another process won the race: theirs is identical
                shutil.rmtree(tmp, ignore_errors=True)
        return out
    if path == SMOLLM2:
        return ensure_smollm2()
    folder = Path(path)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(
            f"model.path {path!r} is not one of {', '.join(REGISTERED_MODELS)} or a local Hugging "
            "Face folder (no config.json there)"
        )
    return folder


def run_model_dir(spec, run_dir: str | Path) -> Path:
    """The model a run starts from: its warm-started ``initial_model`` when `oolong sft` made one,
    else the spec's ``model.path`` (a RunSpec)."""
    initial = Path(run_dir) / "initial_model"
    return initial if (initial / "config.json").exists() else spec_model_dir(spec)


def spec_model_dir(spec) -> Path:
    """The folder of the spec's ``model.path`` (a RunSpec), built or converted on first use."""
    m = spec.model
    return resolve_model_dir(m.path, hidden_size=m.hidden_size, num_layers=m.num_layers,
                             num_heads=m.num_heads)
