"""benchmarks/trl_side.py: TRL's side trains under the same rules as Oolong's trainer. Its
learning rate is constant: transformers' default decays it linearly to 0 over ``max_steps``, so
in a 12-step time_to_accuracy run TRL got half Oolong's mean rate. And no activation
checkpointing, as Oolong's default: TRL's GRPOConfig turns it on, which costs its updates a
third more compute. Handicaps the comparison must not carry."""

from __future__ import annotations

import pytest
import torch

from tests.benchmarks.modules import benchmark

pytestmark = pytest.mark.unit  # no process, network or database (conftest)


def test_trls_learning_rate_is_constant_over_the_run_as_oolongs_is(tmp_path):
    from transformers.optimization import get_scheduler

    steps, lr = 12, 2e-5
    config = benchmark("trl_side").grpo_config(
        tmp_path, steps=steps, seed=1, lr=lr, group_size=8, batch_groups=8, max_new_tokens=32,
        bf16=False, use_cpu=True)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=config.learning_rate)
    schedule = get_scheduler(config.lr_scheduler_type, optimizer,
                             num_warmup_steps=config.get_warmup_steps(steps),
                             num_training_steps=steps)
    rates = []
    for _ in range(steps):
        rates.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert rates == [lr] * steps


def test_trl_recomputes_no_activations_as_oolongs_trainer_does_not_by_default(tmp_path):
    from training_core.config import TrainerSpec

    config = benchmark("trl_side").grpo_config(
        tmp_path, steps=2, seed=1, lr=2e-5, group_size=2, batch_groups=2, max_new_tokens=8,
        bf16=False, use_cpu=True)
    assert config.gradient_checkpointing is False
    assert TrainerSpec().activation_checkpointing is False
