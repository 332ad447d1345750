"""End to end: the proximal shortcut is taken only where exact, and the mismatch metrics show
what a trainer computing in another dtype than the server sees."""

from __future__ import annotations

import math

import pytest

from training_core.config import load_spec
from training_core.metric_names import MISMATCH
from training_core.metrics import read_metrics

SMALL = [
    "model.path=tiny", "data.options={max_value: 9}", "rollout.max_new_tokens=8",
    "rollout.max_concurrent=8", "rollout.group_size=4", "trainer.batch_groups=2",
    "eval.every=0", "checkpoint.every=0", "trainer.steps=2", "rollout.max_staleness=0",
    "reward.fn=builtin:arithmetic", "reward.executor=inline", "trainer.ppo_minibatches=2",
    "trainer.skip_zero_gradient_rows=false",
]


@pytest.mark.slow
def test_a_bf16_trainer_recomputes_every_proximal_row_and_sees_the_mismatch(tmp_path):
    """The trainer in bf16 against the embedded server: auto resolves to 'always' (every row's
    proximal logprobs from a trainer forward, none taken from the server), and the metrics show a
    gap between the two that an fp32 trainer does not have."""
    from training_core.train import train

    spec = load_spec(None, SMALL + ["model.dtype=bfloat16", f"run_dir={tmp_path / 'run'}"])
    assert spec.recompute_proximal_mode == "always"
    result = train(spec, progress=False)
    rows = [r for r in read_metrics(result.run_dir) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["proximal/recomputed_frac"] == 1.0
        assert all(math.isfinite(r[k]) for k in MISMATCH.ALL)
        # bf16 logprobs are ~1e-3 apart from fp32 ones on this model; fp32 reads ~1e-7
        assert r[MISMATCH.abs_logp_diff_max] > 1e-4, r
        assert r[MISMATCH.kl_k3] >= 0 and 0 < r[MISMATCH.ess] <= 1.0 + 1e-9
