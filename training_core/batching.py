"""Turn accepted trajectory groups into padded trainer tensors with per-token advantages."""

from __future__ import annotations

import torch

from training_core.algorithms.advantages import group_advantages, overlong_penalty
from training_core.algorithms.presets import AlgorithmConfig
from training_core.api import PROMPT_VERSION, TrajectoryGroup
from training_core.engines.deepspeed_trainer import TrainBatch


def build_train_batch(groups: list[TrajectoryGroup], *, pad_id: int, algo: AlgorithmConfig,
                      max_new_tokens: int) -> TrainBatch:
    sizes = {len(g.samples) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"all groups must have the same size, got {sorted(sizes)}")
    samples = [s for g in groups for s in g.samples]
    rewards = torch.tensor([[s.reward for s in g.samples] for g in groups], dtype=torch.float32)
    lengths = torch.tensor([[s.num_output_tokens for s in g.samples] for g in groups])
    shaped = rewards + overlong_penalty(lengths, max_new_tokens, algo)
    adv = group_advantages(shaped, algo).reshape(-1)

    width = max(len(s.input_ids) for s in samples)
    n = len(samples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    behav = torch.zeros((n, width), dtype=torch.float32)
    versions = torch.full((n, width), PROMPT_VERSION, dtype=torch.long)
    advantages = torch.zeros((n, width), dtype=torch.float32)
    for i, s in enumerate(samples):
        length = len(s.input_ids)
        input_ids[i, :length] = torch.tensor(s.input_ids)
        attention[i, :length] = 1
        loss_mask[i, :length] = torch.tensor(s.loss_mask, dtype=torch.float32)
        behav[i, :length] = torch.tensor(s.logprobs)
        versions[i, :length] = torch.tensor(s.versions)
        advantages[i, :length] = adv[i] * loss_mask[i, :length]
    return TrainBatch(input_ids, attention, loss_mask, behav, versions, advantages)
