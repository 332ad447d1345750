"""A real model learns: SmolLM2-135M-Instruct on reasoning-gym one-digit sums (the run spec of
benchmarks/learning.py, shortened), greedy accuracy on the same held-out items before and after.

Greedy evaluation is deterministic, so the two evaluations differ only by the weights. The task
starts where the model is right about one time in four (benchmarks/results/learning_scan.json),
so GRPO groups have reward variance from the first step.

Shortened to 14 steps of 6 prompts x 8 samples (the config's batch is 8 prompts): 16 steps of 8
took 10 minutes of a 2-core AVX2 host's suite. 10 steps of 6 gained +27 to +48 points in four
runs there (seeds 1-4; +33 for 16 steps of 8), but the reward rises late, around step 8-9 (an
asynchronous run's schedule is not deterministic), and a loaded suite run on 2026-11-28 had not
started rising by step 10: +5 points. 14 steps leave room for that, against the +10 asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "configs" / "learning-chain-sum.yaml"
STEPS, BATCH_GROUPS, EVAL_ITEMS = 14, 6, 48


@pytest.mark.slow
def test_grpo_raises_smollm2_greedy_accuracy_on_held_out_sums(tmp_path):
    pytest.importorskip("reasoning_gym")
    from training_core.config import load_spec
    from training_core.train import train

    spec = load_spec(CONFIG, [f"run_dir={tmp_path / 'run'}", f"trainer.steps={STEPS}",
                              f"trainer.batch_groups={BATCH_GROUPS}",
                              f"eval.every={STEPS}", f"eval.size={EVAL_ITEMS}",
                              f"data.eval_size={EVAL_ITEMS}", "checkpoint.every=0"])
    result = train(spec, progress=False)
    before, after = result.first_eval["eval/accuracy"], result.last_eval["eval/accuracy"]
    assert 0.10 <= before <= 0.60, f"the task no longer fits the model: starts at {before:.2f}"
    # At least 5 more of the 48 held-out items right (+10 points), not a one-item wobble.
    assert after - before >= 0.10, f"greedy accuracy {before:.3f} -> {after:.3f}"
