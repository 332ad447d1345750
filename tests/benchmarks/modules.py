"""Benchmarks are scripts, not a package: the shape tests load one by path."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (its ``main`` is not run)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
