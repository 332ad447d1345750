"""Which charts the pages draw, grouped by namespace as the metric tiles are (formatting.py).
A chart is (title, metric keys); the browser fetches the series (downsampled in SQL)."""

from __future__ import annotations

Chart = tuple[str, list[str]]

# (group id, title, charts): the run page shows a collapsible section per group.
RUN_CHART_GROUPS: list[tuple[str, str, list[Chart]]] = [
    ("reward", "Reward and evaluation", [
        ("Reward and accuracy", ["reward/mean", "reward/accuracy", "eval/accuracy"]),
        ("Response length", ["response_length/mean", "response_length/max"]),
    ]),
    ("staleness", "Staleness", [
        ("Policy version lag", ["staleness/mean", "staleness/max"]),
        ("Version lag distribution (fraction of tokens)",
         [f"staleness/lag_{k}_frac" for k in range(5)]),
    ]),
    ("rollout", "Rollout", [
        ("Throughput (tokens/s)", ["tokens_per_s", "rollout/tokens_per_s_per_server"]),
        ("Rollout servers", ["rollout/server_busy_frac", "rollout/server_prefill_frac",
                             "rollout/decode_batch_mean"]),
        ("Interrupted, dropped and failed", ["rollout/interruptions",
                                             "rollout/dropped_stale_samples",
                                             "rollout/episode_errors"]),
    ]),
    ("loss", "Loss and optimisation", [
        ("Loss", ["loss"]),
        ("Clip fraction", ["clip_frac"]),
        ("Behaviour weights", ["behav_weight/mean", "behav_weight/max", "behav_weight/masked_frac"]),
        ("Grad norm", ["grad_norm"]),
        ("KL", ["kl"]),
    ]),
    ("time", "Time per step", [
        ("Generation vs training (s)", ["time/generation_wait_s", "time/training_s"]),
        ("Weight sync, export, checkpoint (s)", ["time/weight_sync_pause_s",
                                                 "time/export_weights_s", "time/checkpoint_s"]),
        ("Proximal recompute and borrowed threads", ["proximal/recomputed_frac",
                                                     "time/trainer_threads_borrowed"]),
    ]),
    ("version", "Policy version", [("Weight version", ["version"])]),
]

# Points per line on the compare page: up to 20 runs on one chart, each line ~450 px wide.
COMPARE_BUCKETS = 200
RUN_BUCKETS = 400

# The comparison overlays one metric per chart, one line per run.
COMPARE_CHARTS: list[Chart] = [
    ("Reward (mean sampled)", ["reward/mean"]),
    ("Eval accuracy (greedy)", ["eval/accuracy"]),
    ("Tokens/s", ["tokens_per_s"]),
    ("Staleness (mean lag)", ["staleness/mean"]),
    ("Response length", ["response_length/mean"]),
    ("Step time (s)", ["time/step_s"]),
    ("Loss", ["loss"]),
]
