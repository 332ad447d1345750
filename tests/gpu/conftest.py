"""GPU tests (``pytest -m gpu``; every test under tests/gpu carries the marker, tests/conftest.py
marks by directory). They skip without CUDA, saying why. With CUDA, DeepSpeed must use it:
tests/conftest.py defaults ``DS_ACCELERATOR`` to cpu for the CPU suite, which a trainer on a GPU
cannot run under, so here it becomes cuda before DeepSpeed is first imported."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _deepspeed_on_cuda(monkeypatch):
    if not torch.cuda.is_available():
        return
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name != "cuda":
        pytest.fail(f"DeepSpeed already chose its {name!r} accelerator in this process (it reads "
                    "DS_ACCELERATOR once): run the GPU tests alone with DS_ACCELERATOR=cuda, as "
                    "scripts/gpu_check.sh does")
    if "NCCL_DEBUG" not in os.environ:  # NCCL's own reasons in the log when a group fails
        monkeypatch.setenv("NCCL_DEBUG", "WARN")
