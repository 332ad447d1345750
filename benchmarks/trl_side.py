"""TRL's side of the benchmarks that run it (vs_trl.py, time_to_accuracy.py, gpu_check.py): the
reward wrapper, the step clock and the GRPOConfig they share, so the three run TRL alike. No
side effects at import (gpu_check.py imports it on a 16-core GPU machine)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def trl_reward(scorer: Any, on_prompts: Any = None) -> Any:
    """Our reward as a TRL reward function: the completion's text scored against its row's
    answer (``on_prompts`` sees each batch's prompts first)."""
    def reward(prompts, completions, answer, **_):
        if on_prompts is not None:
            on_prompts(prompts)
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [scorer(c, {"answer": a}) for c, a in zip(texts, answer, strict=True)]
    return reward


def trl_step_clock() -> Any:
    """A TrainerCallback that times each optimizer step (``.step_s``)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.started, self.step_s = 0.0, []

        def on_step_begin(self, args, state, control, **kw):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.step_s.append(time.perf_counter() - self.started)

    return StepClock()


def grpo_config(work: Path, *, steps: int, seed: int, lr: float, group_size: int,
                batch_groups: int, max_new_tokens: int, bf16: bool, use_cpu: bool) -> Any:
    """TRL's GRPOConfig as the three benchmarks run it: one optimizer step per generated batch
    of ``batch_groups`` prompts x ``group_size`` samples, no KL (beta 0, as Oolong's grpo), a
    constant learning rate (as Oolong's trainer; transformers' default decays it linearly to 0
    over ``max_steps``, which gave TRL half the mean rate in a 12-step run), no activation
    checkpointing (as Oolong's default, ``trainer.activation_checkpointing``; TRL's GRPOConfig
    turns it on, a third more compute per update at no gain for a model this size), no saving
    or logging of its own."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(work / "trl"), max_steps=steps, learning_rate=lr, seed=seed,
        lr_scheduler_type="constant", gradient_checkpointing=False,
        per_device_train_batch_size=group_size * batch_groups, num_generations=group_size,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        max_completion_length=max_new_tokens, temperature=1.0, beta=0.0, use_cpu=use_cpu,
        bf16=bf16, fp16=False, logging_steps=1, report_to=[], save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0)
