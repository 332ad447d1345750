"""Load ``package.module:attribute`` paths named in a run spec (workflows, rewards, backends)."""

from __future__ import annotations

import importlib
from typing import Any


def import_string(path: str, *, field: str, kind: str = "attribute") -> Any:
    """The object at ``module:attribute``. Errors name the spec ``field`` and what went wrong
    (``kind`` says what was expected there: a function, a class)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{field} {path!r} must look like 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{field} {path!r}: cannot import module {module_name!r} ({exc})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{field} {path!r}: module {module_name!r} has no {kind} {attr!r}") from None
