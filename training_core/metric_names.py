"""Every metric name a run reports, declared once.

The producers (train.py's loop and timers, step_metrics.py, evaluation.py, the rollout
correction, the rollout profile, agent workflows) and the readers (the web app's charts, run
header, run list, compare view and tracker selectors; the CLI) use these names. Two tests hold
them together: ``tests/test_metric_names.py`` fails when a chart, the header or a list names
a metric not declared here, and the end-to-end training test when a run writes one that is not.

Light on purpose (no imports): the web app imports it.
"""

from __future__ import annotations

DECLARED: set[str] = set()


def _name(name: str) -> str:
    DECLARED.add(name)
    return name


# ---- the batch (step_metrics.batch_metrics) ----------------------------------------------------
REWARD_MEAN = _name("reward/mean")
REWARD_STD = _name("reward/std")
REWARD_ACCURACY = _name("reward/accuracy")  # samples scoring at least evaluation.CORRECT
REWARD_ERRORS = _name("reward/errors")  # samples whose reward raised, timed out or died
REWARD_ERROR_FRAC = _name("reward/error_frac")  # the same, as a fraction of the batch
RESPONSE_LENGTH_MEAN = _name("response_length/mean")
RESPONSE_LENGTH_MAX = _name("response_length/max")
STALENESS_MEAN = _name("staleness/mean")  # policy versions between a token and the update
STALENESS_MAX = _name("staleness/max")
STALENESS_LAGS = tuple(_name(f"staleness/lag_{k}_frac") for k in range(5))
INTERRUPTIONS = _name("rollout/interruptions")
# samples whose max_new_tokens the client cut to what the servers' context left (rollout_client)
BUDGET_CLAMPED_FRAC = _name("rollout/budget_clamped_frac")
TRUNCATED_FRAC = _name("rollout/truncated_frac")

# ---- agent episodes (workflows/agent.py); present on agent runs only ----------------------------
AGENT = tuple(_name(f"agent/{k}") for k in (
    "turns", "segments", "forks", "tool_calls", "tool_parse_failures", "retries",
    "sampling_overrides", "rejected_requests"))
# Per step, over the tokens that train: how large the advantages are (agent credit is bounded by
# construction, gateway/credit.py; a jump here is the first sign of a reward out of scale).
ADVANTAGE_ABS_MEAN = _name("advantage/abs_mean")
ADVANTAGE_ABS_MAX = _name("advantage/abs_max")

# ---- the update and the step (step_metrics.step_metrics) -----------------------------------------
LOSS = _name("loss")
CLIP_FRAC = _name("clip_frac")
BEHAV_WEIGHT_MEAN = _name("behav_weight/mean")
BEHAV_WEIGHT_MAX = _name("behav_weight/max")
BEHAV_WEIGHT_MASKED_FRAC = _name("behav_weight/masked_frac")
KL = _name("kl")
COMPUTED_ROWS_FRAC = _name("update/computed_rows_frac")
GRAD_NORM = _name("grad_norm")
PROXIMAL_RECOMPUTED_FRAC = _name("proximal/recomputed_frac")
THREADS_BORROWED = _name("time/trainer_threads_borrowed")
TOKENS_CONSUMED = _name("tokens/consumed")
TOKENS_PER_S = _name("tokens_per_s")
QUEUE_DEPTH = _name("rollout/queue_depth")
REJECTED_GROUPS = _name("rollout/rejected_groups")
DROPPED_STALE = _name("rollout/dropped_stale_samples")
EPISODE_ERRORS = _name("rollout/episode_errors")
RUNNING = _name("rollout/running")
VERSION = _name("version")
STEP_S = _name("time/step_s")
GENERATION_WAIT_S = _name("time/generation_wait_s")
TRAINING_S = _name("time/training_s")

# ---- named timers: train.Timers reports each as time/<name>_s ------------------------------------
TIMERS = ("wait_rollout", "prepare", "proximal_logp", "update", "export_weights",
          "weight_sync_pause", "eval_wait", "checkpoint", "checkpoint_upload",
          "forward", "backward", "optimizer")  # the last three: the trainer's own split


def timer(name: str) -> str:
    """``time/<name>_s`` for a declared timer."""
    if name not in TIMERS:
        raise KeyError(f"timer {name!r} is not declared in training_core.metric_names.TIMERS")
    return f"time/{name}_s"


for _t in TIMERS:
    _name(timer(_t))
WEIGHT_SYNC_PAUSE_S = timer("weight_sync_pause")
EXPORT_WEIGHTS_S = timer("export_weights")
CHECKPOINT_S = timer("checkpoint")

# ---- the rollout servers' side (rollout_profile.py): embedded servers only ------------------------
SERVER_BUSY_FRAC = _name("rollout/server_busy_frac")
SERVER_PREFILL_FRAC = _name("rollout/server_prefill_frac")
SERVER_TOKENS_PER_S = _name("rollout/tokens_per_s_per_server")
DECODE_BATCH_MEAN = _name("rollout/decode_batch_mean")

# ---- evaluation (evaluation.py) ------------------------------------------------------------------
EVAL_ACCURACY = _name("eval/accuracy")  # greedy, on held-out rows
EVAL_REWARD = _name("eval/reward")
EVAL_ERRORS = _name("eval/errors")  # eval rows whose generation or scoring failed (scored 0)
EVAL_SECONDS = _name("eval/seconds")  # one evaluation's own length (beside training: eval_wait)
# Per eval set (eval_stats.py, evaluation.evaluate_sets): eval/<set>/<metric>. A run's own
# held-out set is DEFAULT_EVAL_SET; each *_ci_lo / *_ci_hi pair is the metric's 95% interval.
DEFAULT_EVAL_SET = "heldout"
EVAL_SET_METRICS = (
    "questions", "version", "errors", "overlap_train_pool", "seen_in_trained_batch",
    "greedy_accuracy", "greedy_accuracy_ci_lo", "greedy_accuracy_ci_hi",
    "avg@k", "avg@k_ci_lo", "avg@k_ci_hi", "pass@k", "pass@k_ci_lo", "pass@k_ci_hi",
    "maj@k", "maj@k_ci_lo", "maj@k_ci_hi", "k", "n")


def eval_set_metric(set_name: str, metric: str) -> str:
    """``eval/<set>/<metric>``, declared (a set's name comes from the run's data)."""
    if metric not in EVAL_SET_METRICS:
        raise ValueError(f"unknown eval metric {metric!r}; use one of {', '.join(EVAL_SET_METRICS)}")
    return _name(f"eval/{set_name}/{metric}")


EVAL_HELDOUT = {m: eval_set_metric(DEFAULT_EVAL_SET, m) for m in EVAL_SET_METRICS}
OFFLINE_EVAL_ACCURACY = _name("offline_eval/accuracy")  # a stored run's weights, evaluated later
OFFLINE_EVAL_REWARD = _name("offline_eval/reward")
OFFLINE_EVAL_ROWS = _name("offline_eval/rows")


class MISMATCH:
    """Rollout-training mismatch, per step (algorithms/correction.py): behaviour policy (the
    rollout servers' logprobs) against the proximal policy (the trainer's, before the update),
    over the output tokens of the samples the update computed."""

    kl_k1 = _name("mismatch/kl_k1")  # KL(behav || prox), k1: mean of log(pi_behav/pi_prox)
    kl_k3 = _name("mismatch/kl_k3")  # KL(behav || prox), k3: mean of r - 1 - log r, r = w
    abs_logp_diff_max = _name("mismatch/abs_logp_diff_max")  # max |logp_prox - logp_behav|
    weight_mean = _name("mismatch/weight_mean")  # importance weight w = pi_prox / pi_behav
    weight_max = _name("mismatch/weight_max")
    ess = _name("mismatch/ess")  # effective sample size of w, normalised to (0, 1]
    token_masked_frac = _name("mismatch/token_masked_frac")  # tokens a token-level mask removed
    token_clipped_frac = _name("mismatch/token_clipped_frac")  # tokens whose weight TIS truncated
    removed_frac = _name("mismatch/removed_frac")  # tokens any correction rule removed
    seq_masked_frac = _name("mismatch/seq_masked_frac")  # sequences the sequence rule removed
    opsm_masked_frac = _name("mismatch/opsm_masked_frac")  # sequences OPSM removed

    ALL = (kl_k1, kl_k3, abs_logp_diff_max, weight_mean, weight_max, ess, token_masked_frac,
           token_clipped_frac, removed_frac, seq_masked_frac, opsm_masked_frac)


# Not metrics: what every line of metrics.jsonl carries besides them.
LINE_FIELDS = frozenset({"step", "time"})
