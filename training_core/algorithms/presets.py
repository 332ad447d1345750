"""Algorithm presets are data, not code forks: each is a set of knobs the loss and the
advantage functions read. A run spec field left ``None`` takes its preset's value.

Normalisation: every preset divides the summed token losses by the number of output tokens in
the global batch (a token mean, as DAPO and Dr.GRPO recommend). So ``grpo`` here has no
per-sequence 1/|o| factor: long and short answers weigh by their tokens. What ``dr_grpo`` changes
on top is only the advantage: no division by the group's reward std (that std favours groups that
are almost all right or all wrong).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Literal


@dataclass(frozen=True)
class AlgorithmConfig:
    baseline: Literal["group_mean", "leave_one_out", "batch_mean"] = "group_mean"
    normalize_std: bool = True
    # The reward std advantages divide by: "sample" (n - 1, as verl, AReaL and TRL) or
    # "population" (n). Only read when normalize_std is on.
    std_estimator: Literal["sample", "population"] = "sample"
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    decoupled: bool = True
    behav_weight_cap: float = 5.0
    behav_weight_mode: Literal["mask", "clip"] = "mask"
    kl_coef: float = 0.0
    dynamic_filter: bool = False
    overlong_buffer: float = 0.0  # DAPO soft overlong window, a fraction of max_new_tokens
    overlong_penalty: float = 0.0  # reward subtracted at the very end of the window


PRESETS: dict[str, AlgorithmConfig] = {
    # GRPO: group-normalised outcome rewards.
    "grpo": AlgorithmConfig(),
    # Dr.GRPO: no std normalisation (removes the difficulty bias).
    "dr_grpo": AlgorithmConfig(normalize_std=False),
    # RLOO: leave-one-out mean baseline, no std.
    "rloo": AlgorithmConfig(baseline="leave_one_out", normalize_std=False),
    # DAPO: clip-higher, dynamic filtering of all-same groups, soft overlong penalty.
    "dapo": AlgorithmConfig(
        eps_clip_high=0.28, dynamic_filter=True, overlong_buffer=0.2, overlong_penalty=1.0
    ),
    # Plain PPO-style policy gradient with a KL penalty to the initial policy (k2 in the loss).
    "ppo_kl": AlgorithmConfig(baseline="batch_mean", normalize_std=False, kl_coef=0.05),
}


def resolve_algorithm(preset: str, **overrides: object) -> AlgorithmConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown algorithm preset {preset!r}; use one of {', '.join(PRESETS)}")
    known = {f.name for f in fields(AlgorithmConfig)}
    given = {k: v for k, v in overrides.items() if v is not None and k in known}
    return replace(PRESETS[preset], **given)
