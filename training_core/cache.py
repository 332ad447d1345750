"""Where the engine keeps what it builds once per machine: converted models, the tiny model, the
CPU kernels' builds and their recorded choices, the platform's build trees."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "OOLONG_CACHE"


def cache_root() -> Path:
    """``$OOLONG_CACHE``, else ``~/.cache/oolong``."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "oolong"))
