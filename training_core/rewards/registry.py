"""Resolve ``builtin:<name>`` or ``package.module:function`` to a callable."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from training_core.rewards.builtin import BUILTINS

RewardCallable = Callable[[str, dict[str, Any]], float]

# User reward code (from the web app) becomes module <package>.r<reward id>_v<version> on the node.
USER_REWARD_PACKAGE = "oolong_user_rewards"
USER_REWARD = re.compile(rf"^{USER_REWARD_PACKAGE}\.(r\d+_v\d+):(\w+)$")


def user_reward_fn_path(reward_id: int, version: int, entrypoint: str) -> str:
    return f"{USER_REWARD_PACKAGE}.r{reward_id}_v{version}:{entrypoint}"


def resolve_reward(path: str) -> RewardCallable:
    kind, sep, name = path.partition(":")
    if not sep:
        raise ValueError(f"reward.fn {path!r} must be 'builtin:<name>' or 'module:function'")
    if kind == "builtin":
        if name not in BUILTINS:
            raise ValueError(f"reward.fn builtin:{name} is unknown; use one of {', '.join(BUILTINS)}")
        return BUILTINS[name]
    try:
        module = importlib.import_module(kind)
    except ImportError as exc:
        raise ValueError(f"reward.fn {path!r}: cannot import module {kind!r} ({exc})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward.fn {path!r}: module {kind!r} has no function {name!r}")
    return fn
