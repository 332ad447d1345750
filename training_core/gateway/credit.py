"""Credit for agent episodes: rewards per trajectory or per completion, an optional discount
across turns, the group baseline over the G trajectories of one task item; bounded by
construction.

An episode with completions (turns) t = 0..T-1 has per-turn rewards r_t: the agent's list (one
per completion), or a single float R given as r_{T-1} = R. Its return-to-go from turn t is
``G_t = sum_{k >= t} gamma^(k-t) r_k`` and its return is ``G_0``.

A token of turn t of episode i gets ``A_i + (G_{i,t} - G_{i,0}) * c``:

- ``A_i`` is the preset's advantage of the trajectory over the returns ``G_0`` of its group
  (GRPO, Dr.GRPO, RLOO, DAPO: the G episodes of one task item; ``ppo_kl``'s batch mean: every
  episode of the batch), exactly as for single-turn samples;
- the per-turn term is never divided by the group's spread: ``c`` is 1 / (the largest |G| of the
  group) for presets that normalise (so it is at most 2 in magnitude, the units of A_i), and 1
  for those that do not (reward units, as their A_i);
- a group whose returns ``G_0`` are all equal (within 1e-6 of the largest) carries no signal:
  every token gets 0, whatever the discount or the per-turn split. A run on a task every
  episode solves trains with loss and gradient norm zero.

With gamma = 1 and one float every turn gets ``A_i``: the trajectory-level GRPO of rLLM/AReaL.

Every segment of a trajectory is its own row, carrying these per-token advantages; prompt tokens
(tool results, user turns) have loss mask 0.
"""

from __future__ import annotations

from typing import Any

import torch

from training_core.algorithms.advantages import group_advantages
from training_core.algorithms.presets import AlgorithmConfig
from training_core.api import Trajectory, TrajectoryGroup
from training_core.gateway.session import NOT_A_TURN, Session
from training_core.rewards.bounds import REWARD_MAX_ABS, reward_value_problem


class BadReward(ValueError):
    """The agent returned something that is not a reward for this episode."""


def turn_returns(reward: Any, turns: int, discount: float,
                 max_abs: float = REWARD_MAX_ABS) -> list[float]:
    """G_t for t = 0..turns-1 (see the module doc). Whatever the agent returned is checked where
    it enters: numbers only (``[None]`` is a bad reward of this episode, not a crash of the run),
    each finite and within ``max_abs`` (``reward.max_abs``), and each return after summing too
    (per-turn rewards of 1e308 sum to inf)."""
    if isinstance(reward, bool) or not isinstance(reward, int | float | list | tuple):
        raise BadReward(f"the agent returned {type(reward).__name__}: return a float reward or a "
                        "list with one float per completion")
    if isinstance(reward, list | tuple):
        if len(reward) != turns:
            raise BadReward(f"the agent returned {len(reward)} rewards for {turns} completions: "
                            "return one per completion, or one float")
        values = list(reward)
    else:
        values = [0.0] * (turns - 1) + [reward] if turns else []
    per_turn = [_checked(r, max_abs, "reward") for r in values]
    out, running = [0.0] * turns, 0.0
    for t in range(turns - 1, -1, -1):
        running = per_turn[t] + discount * running
        out[t] = _checked(running, max_abs, f"return of turn {t} (rewards summed)")
    return out


def _checked(value: Any, max_abs: float, what: str) -> float:
    problem = reward_value_problem(value, max_abs)
    if problem is not None:
        raise BadReward(f"the agent's {what} {problem}")
    return float(value)


def episode_trajectories(session: Session, reward: Any, *, episode: int,
                         discount: float = 1.0, max_abs: float = REWARD_MAX_ABS) -> list[Trajectory]:
    """The session's segments as rows: exact ids, behaviour logprobs and versions as sampled."""
    if session.turns == 0:
        raise BadReward("the agent made no chat completion")
    returns = turn_returns(reward, session.turns, discount, max_abs)
    rows = []
    for k, seg in enumerate(session.segments):
        token_returns = [returns[t] if t != NOT_A_TURN else 0.0 for t in seg.turns]
        rows.append(Trajectory(
            input_ids=list(seg.ids), loss_mask=list(seg.mask), logprobs=list(seg.logprobs),
            versions=list(seg.versions), reward=returns[0],
            truncated=False,
            info={"episode": episode, "segment": k, "token_returns": token_returns,
                  "turn_ids": list(seg.turns), "episode_return": returns[0],
                  "interruptions": session.interruptions if k == 0 else 0,
                  "completion": " | ".join(e["completion"] for e in session.log
                                           if e["segment"] == k),
                  "turns_log": [{**e, "return": returns[e["turn"]]} for e in session.log
                                if e["segment"] == k],
                  # an agent's own temperatures (sampling: pass); 0.0 = the run's
                  **({"token_temperatures": list(seg.temperatures)}
                     if any(seg.temperatures) else {}),
                  **(session.metrics() if k == 0 else {})}))
    return rows


SPREAD_EPS = 1e-6


def _episodes(groups: list[TrajectoryGroup]) -> list[dict[int, float]]:
    """Per group, episode -> its return G_0."""
    out = []
    for group in groups:
        episodes: dict[int, float] = {}
        for s in group.samples:
            episodes.setdefault(s.info["episode"], s.info["episode_return"])
        out.append(episodes)
    return out


def _scale(values: list[float]) -> float:
    return max((abs(v) for v in values), default=0.0)


def segment_advantages(groups: list[TrajectoryGroup], algo: AlgorithmConfig,
                       eps: float = 1e-6) -> list[list[float]]:
    """Per row (segment) and token, the advantage (module doc); the rows in the order of
    ``[s for g in groups for s in g.samples]``."""
    per_group = _episodes(groups)
    batch = algo.baseline == "batch_mean"
    # The population the baseline compares: the batch for batch_mean, else each group.
    populations = [[r for eps_ in per_group for r in eps_.values()]] * len(groups) if batch \
        else [list(e.values()) for e in per_group]
    if batch:
        everything = torch.tensor([populations[0]], dtype=torch.float32)
        flat = group_advantages(everything, algo)[0].tolist()
        advantages, k = [], 0
        for episodes in per_group:
            advantages.append(dict(zip(episodes, flat[k:k + len(episodes)], strict=True)))
            k += len(episodes)
    else:
        advantages = []
        for episodes in per_group:
            keys = list(episodes)
            if len(keys) < 2:  # no baseline to compare with: no signal
                advantages.append(dict.fromkeys(keys, 0.0))
                continue
            returns = torch.tensor([[episodes[k] for k in keys]], dtype=torch.float32)
            advantages.append(dict(zip(keys, group_advantages(returns, algo)[0].tolist(),
                                       strict=True)))
    out: list[list[float]] = []
    for group, adv, population in zip(groups, advantages, populations, strict=True):
        flat = len(population) < 2 or max(population) - min(population) <= SPREAD_EPS * max(
            1.0, _scale(population))
        turn_returns_ = [g for s in group.samples for g, m in
                         zip(s.info["token_returns"], s.loss_mask, strict=True) if m]
        c = 1.0 / (_scale(population + turn_returns_) + eps) if algo.normalize_std else 1.0
        for s in group.samples:
            if flat:
                out.append([0.0] * len(s.loss_mask))
                continue
            base, g0 = adv[s.info["episode"]], s.info["episode_return"]
            out.append([(base + (g - g0) * c) if m else 0.0
                        for g, m in zip(s.info["token_returns"], s.loss_mask, strict=True)])
    return out
