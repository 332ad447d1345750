"""What free-form JSON from a client may hold before it is stored: PostgreSQL's text and jsonb
cannot hold NUL characters, the JSON renderer cannot write NaN or infinity, and nesting has a
depth limit. A violation is a 400 naming the exact path (``spec.trainer.name``)."""

from __future__ import annotations

import math
from typing import Any

from webapp.core.errors import ApplicationError

MAX_DEPTH = 32


def json_problem(value: Any, path: str = "", depth: int = 0) -> tuple[str, str] | None:
    """The first bad part of ``value`` as (path, reason), or None."""
    if depth > MAX_DEPTH:
        return path, f"is nested deeper than {MAX_DEPTH} levels"
    if isinstance(value, str):
        return (path, "contains a NUL character (\\u0000)") if "\x00" in value else None
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, "must be a finite number")
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if "\x00" in str(key):
                return path or "(root)", "has a key with a NUL character (\\u0000)"
            if (found := json_problem(item, where, depth + 1)) is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if (found := json_problem(item, f"{path}[{i}]", depth + 1)) is not None:
                return found
    return None


def json_check(value: Any, field: str) -> Any:
    """Return ``value`` unchanged, or raise the 400 for its first bad part."""
    found = json_problem(value, field, 0)
    if found is not None:
        raise ApplicationError(f"{found[0]} {found[1]}", field=found[0])
    return value
