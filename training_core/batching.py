"""Turn accepted trajectory groups into padded trainer tensors with per-token advantages."""

from __future__ import annotations

import torch

from training_core.algorithms.advantages import group_advantages, overlong_penalty
from training_core.algorithms.presets import AlgorithmConfig
from training_core.api import PROMPT_VERSION, TrainBatch, TrajectoryGroup


def build_train_batch(groups: list[TrajectoryGroup], *, pad_id: int, algo: AlgorithmConfig,
                      max_new_tokens: int) -> TrainBatch:
    samples = [s for g in groups for s in g.samples]
    token_adv = None
    if any("episode" in s.info for s in samples):
        # Agent episodes: a trajectory is several segments (rows), credit per token, the group
        # baseline over trajectories (training_core/gateway/credit.py).
        from training_core.gateway.credit import segment_advantages

        token_adv = segment_advantages(groups, algo)
    else:
        sizes = {len(g.samples) for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"all groups must have the same size, got {sorted(sizes)}")
        rewards = torch.tensor([[s.reward for s in g.samples] for g in groups], dtype=torch.float32)
        # DAPO's budget is per generation: a multi-turn trajectory is judged by its longest turn,
        # not by its output tokens summed over turns.
        lengths = torch.tensor([[longest_turn(s.loss_mask) for s in g.samples] for g in groups])
        shaped = rewards + overlong_penalty(lengths, max_new_tokens, algo)
        adv = group_advantages(shaped, algo).reshape(-1)

    # Pad as Python lists and convert once per field: per-sample tensor copies cost more than
    # the forward pass for small models.
    width = max(len(s.input_ids) for s in samples)

    def pad(rows, value):
        return [list(r) + [value] * (width - len(r)) for r in rows]

    # Samples dropped at consume time (too stale) leave the loss only: their lengths and rewards
    # above still shape their group's advantages exactly as if they had been kept.
    keep = torch.tensor([[0.0 if s.dropped else 1.0] for s in samples])
    loss_mask = torch.tensor(pad([s.loss_mask for s in samples], 0), dtype=torch.float32) * keep
    lengths_t = torch.tensor([len(s.input_ids) for s in samples])
    attention = (torch.arange(width).unsqueeze(0) < lengths_t.unsqueeze(1)).long()
    return TrainBatch(
        input_ids=torch.tensor(pad([s.input_ids for s in samples], pad_id), dtype=torch.long),
        attention_mask=attention,
        loss_mask=loss_mask,
        behav_logp=torch.tensor(pad([s.logprobs for s in samples], 0.0), dtype=torch.float32),
        versions=torch.tensor(pad([s.versions for s in samples], PROMPT_VERSION), dtype=torch.long),
        advantages=(adv.view(-1, 1) if token_adv is None
                    else torch.tensor(pad(token_adv, 0.0), dtype=torch.float32)) * loss_mask,
        # An agent's own temperatures (gateway: rollout.agent.sampling pass), 0 = the run's.
        temperatures=torch.tensor(pad([s.info.get("token_temperatures") or [0.0] * len(s.input_ids)
                                       for s in samples], 0.0), dtype=torch.float32)
        if any(s.info.get("token_temperatures") for s in samples) else None,
    )


def longest_turn(loss_mask: list[int]) -> int:
    """The longest run of consecutive generated tokens: one turn's output. Turns of a multi-turn
    trajectory are separated by the tokens the workflow added (feedback, tool results), which
    have loss mask 0; a single-turn sample is one run, its whole output."""
    best = run = 0
    for m in loss_mask:
        run = run + 1 if m else 0
        best = max(best, run)
    return best


def rows_with_gradient(batch: TrainBatch, *, kl: bool) -> list[int]:
    """The rows whose loss can have a non-zero gradient: those with a loss token whose advantage
    is not zero, or, with a KL term (``kl``), any loss token.

    Every other row adds exactly zero to the policy loss and its gradient: the clipped surrogate
    of a token is ``w * max(-A r, -A clip(r))``, 0 for ``A = 0`` whatever the ratio, and a row
    without loss tokens (a prompt-only row, a sample dropped as too stale) is masked out whole.
    GRPO-style advantages make such rows common: a group whose samples all got the same reward
    (all right on an easy task, all wrong on a hard one) has ``A = 0`` for every token. The
    trainer skips their forward and backward; they still count in the token-mean denominator."""
    signal = batch.loss_mask.bool() if kl else (batch.advantages != 0) & batch.loss_mask.bool()
    return signal.any(dim=1).nonzero().flatten().tolist()
