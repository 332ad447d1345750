"""Which charts the pages draw, grouped by namespace as the metric tiles are (formatting.py).
A chart is (title, metric keys); the browser fetches the series (downsampled in SQL)."""

from __future__ import annotations

from training_core import metric_names as M
from training_core.metric_names import EVAL_ERRORS, MISMATCH, REWARD_ERROR_FRAC

Chart = tuple[str, list[str]]

# (group id, title, charts): the run page shows a collapsible section per group.
RUN_CHART_GROUPS: list[tuple[str, str, list[Chart]]] = [
    ("reward", "Reward and evaluation", [
        ("Reward and accuracy", [M.REWARD_MEAN, M.REWARD_ACCURACY, M.EVAL_ACCURACY]),
        ("Response length", [M.RESPONSE_LENGTH_MEAN, M.RESPONSE_LENGTH_MAX]),
        ("Failed rewards (fraction of samples)", [REWARD_ERROR_FRAC]),
        ("Failed eval rows", [EVAL_ERRORS]),
    ]),
    ("staleness", "Staleness", [
        ("Policy version lag", [M.STALENESS_MEAN, M.STALENESS_MAX]),
        ("Version lag distribution (fraction of tokens)",
         list(M.STALENESS_LAGS)),
    ]),
    ("rollout", "Rollout", [
        ("Throughput (tokens/s)", [M.TOKENS_PER_S, M.SERVER_TOKENS_PER_S]),
        ("Rollout servers", [M.SERVER_BUSY_FRAC, M.SERVER_PREFILL_FRAC,
                             M.DECODE_BATCH_MEAN]),
        ("Interrupted, dropped and failed", [M.INTERRUPTIONS, M.DROPPED_STALE,
                                             M.EPISODE_ERRORS]),
    ]),
    ("mismatch", "Rollout–training mismatch", [
        ("KL(behaviour ‖ proximal)", [MISMATCH.kl_k1, MISMATCH.kl_k3]),
        ("Max |Δ logprob|", [MISMATCH.abs_logp_diff_max]),
        ("Importance weights π_prox / π_behav", [MISMATCH.weight_mean, MISMATCH.weight_max]),
        ("Effective sample size (normalised)", [MISMATCH.ess]),
        ("Removed or clipped by the correction", [
            MISMATCH.token_masked_frac, MISMATCH.token_clipped_frac, MISMATCH.removed_frac,
            MISMATCH.seq_masked_frac, MISMATCH.opsm_masked_frac]),
    ]),
    ("loss", "Loss and optimisation", [
        ("Loss", [M.LOSS]),
        ("Clip fraction", [M.CLIP_FRAC]),
        ("Behaviour weights", [M.BEHAV_WEIGHT_MEAN, M.BEHAV_WEIGHT_MAX,
                                M.BEHAV_WEIGHT_MASKED_FRAC]),
        ("Grad norm", [M.GRAD_NORM]),
        ("KL", [M.KL]),
    ]),
    ("time", "Time per step", [
        ("Generation vs training (s)", [M.GENERATION_WAIT_S, M.TRAINING_S]),
        ("Weight sync, export, checkpoint (s)", [M.WEIGHT_SYNC_PAUSE_S,
                                                 M.EXPORT_WEIGHTS_S, M.CHECKPOINT_S]),
        ("Proximal recompute and borrowed threads", [M.PROXIMAL_RECOMPUTED_FRAC,
                                                     M.THREADS_BORROWED]),
    ]),
    ("version", "Policy version", [("Weight version", [M.VERSION])]),
]

# Points per line on the compare page: up to 20 runs on one chart, each line ~450 px wide.
COMPARE_BUCKETS = 200
RUN_BUCKETS = 400

# The comparison overlays one metric per chart, one line per run.
COMPARE_CHARTS: list[Chart] = [
    ("Reward (mean sampled)", [M.REWARD_MEAN]),
    ("Eval accuracy (greedy)", [M.EVAL_ACCURACY]),
    ("Tokens/s", [M.TOKENS_PER_S]),
    ("Staleness (mean lag)", [M.STALENESS_MEAN]),
    ("Response length", [M.RESPONSE_LENGTH_MEAN]),
    ("Step time (s)", [M.STEP_S]),
    ("Loss", [M.LOSS]),
]
