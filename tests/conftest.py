"""Test-wide settings: one torch thread per process (two collapse under contention on 2 cores),
a repo-local model cache, CPU DeepSpeed."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OOLONG_CACHE", str(ROOT / ".cache" / "oolong"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
