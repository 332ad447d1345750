"""What a reward value may be: one rule for every way a reward enters a run (the reward pool,
whatever executed the call; an agent's return; an online client's posted reward)."""

from __future__ import annotations

import math
from typing import Any

REWARD_MAX_ABS = 1e6  # config.RewardSpec.max_abs's default


def reward_value_problem(value: Any, max_abs: float) -> str | None:
    """Why ``value`` is not a reward (None: it is one): not a number, not finite, or beyond
    +-``max_abs`` (``reward.max_abs``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"returned {type(value).__name__}, not a number"
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        return (f"returned an integer of {value.bit_length()} bits, outside +-{max_abs:g} "
                "(reward.max_abs)")
    if not math.isfinite(number):
        return f"returned {number}, not a finite number"
    if abs(number) > max_abs:
        return f"returned {number:g}, outside +-{max_abs:g} (reward.max_abs)"
    return None
