"""Test-wide settings: one torch thread per process (two collapse under contention on 2 cores),
a repo-local model cache, CPU DeepSpeed; and every test marked by the directory it lives in, which
is what it costs (``pytest -m unit`` is make test-fast; ``-m "not integration"`` and so on)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OOLONG_CACHE", str(ROOT / ".cache" / "oolong"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


# tests/<directory> -> the marker its tests carry (registered in pyproject.toml).
COST_MARKERS = {"unit": "unit", "training_core": "engine", "webapp": "web", "security": "security",
                "orchestration": "orchestration", "integration": "integration", "infra": "infra",
                "benchmarks": "benchmarks", "workers": "workers"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(ROOT / "tests").parts
        marker = COST_MARKERS.get(parts[0]) if len(parts) > 1 else "layout"
        item.add_marker(getattr(pytest.mark, marker or parts[0]))
