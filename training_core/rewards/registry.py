"""Resolve ``builtin:<name>`` or ``package.module:function`` to a callable."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from training_core.imports import import_string
from training_core.rewards.builtin import BuiltinReward

RewardCallable = Callable[[str, dict[str, Any]], float]

# User reward code (from the web app) becomes module <package>.r<reward id>_v<version> on the node.
USER_REWARD_PACKAGE = "oolong_user_rewards"
USER_REWARD = re.compile(rf"^{USER_REWARD_PACKAGE}\.(r\d+_v\d+):(\w+)$")


def user_reward_fn_path(reward_id: int, version: int, entrypoint: str) -> str:
    return f"{USER_REWARD_PACKAGE}.r{reward_id}_v{version}:{entrypoint}"


class FunctionReward:
    """A user's ``fn(completion, item) -> float``: it sees the raw completion, extracts nothing."""

    def __init__(self, fn: RewardCallable):
        self.fn = fn

    def extracted(self, completion: str) -> str | None:
        return None

    def __call__(self, completion: str, item: dict[str, Any]) -> float:
        return self.fn(completion, item)


def parse_reward_path(path: str, extract: str = "auto") -> tuple[str, str]:
    """``(kind, name)``: ``("builtin", name)`` or ``(module, function)``, with the path's format
    and the extract option checked (extraction applies to built-in rewards only)."""
    kind, sep, name = path.partition(":")
    if not sep or not name.isidentifier():
        raise ValueError(f"reward.fn {path!r} must be 'builtin:<name>' or 'module:function'")
    if kind != "builtin" and extract not in ("auto", "none"):
        raise ValueError(f"reward.extract {extract!r} applies to built-in rewards only; a "
                         "function reward gets the raw completion")
    return kind, name


def resolve_reward(path: str, extract: str = "auto") -> BuiltinReward | FunctionReward:
    """The reward at ``path``: a callable with ``extracted(completion)`` for the trajectory view."""
    kind, name = parse_reward_path(path, extract)
    if kind == "builtin":
        return BuiltinReward(name, extract)
    fn = import_string(path, field="reward.fn", kind="function")
    if not callable(fn):
        raise ValueError(f"reward.fn {path!r}: {name!r} is not a function")
    return FunctionReward(fn)
