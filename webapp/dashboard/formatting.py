"""How the run page shows a metric: grouped by namespace, integers as integers, units on times,
rates and fractions."""

from __future__ import annotations

from training_core import metric_names as M

GROUP_ORDER = ["reward", "eval", "staleness", "rollout", "mismatch", "loss", "tokens", "time",
               "proximal"]
LOSS_KEYS = {M.LOSS, M.KL, M.GRAD_NORM, M.CLIP_FRAC, M.VERSION, M.TOKENS_PER_S}


def metric_group(key: str) -> str:
    if "/" in key:
        return key.split("/", 1)[0]
    return "loss" if key in LOSS_KEYS else "train"


def format_metric(key: str, value: float) -> str:
    name = key.rsplit("/", 1)[-1]
    if name.endswith("_frac") or name in ("accuracy", "clip_frac"):
        return f"{value * 100:.1f}%"
    if name.endswith("per_s"):
        return f"{value:,.0f}/s"
    if name.endswith("_s"):
        return f"{value * 1000:.0f} ms" if abs(value) < 1 else f"{value:,.2f} s"
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:.4g}"


def grouped_metrics(latest: dict[str, float]) -> list[tuple[str, list[tuple[str, str]]]]:
    """[(group, [(key, shown value), ...]), ...] in a fixed group order, keys sorted."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for key in sorted(latest):
        groups.setdefault(metric_group(key), []).append((key, format_metric(key, latest[key])))
    order = {g: i for i, g in enumerate(GROUP_ORDER)}
    return sorted(groups.items(), key=lambda item: (order.get(item[0], len(order)), item[0]))


GLANCE = [(M.REWARD_MEAN, "reward"), (M.EVAL_ACCURACY, "eval accuracy"),
          (M.TOKENS_PER_S, "tokens/s"), (M.STALENESS_MEAN, "staleness mean"),
          (M.STALENESS_MAX, "staleness max"), (M.WEIGHT_SYNC_PAUSE_S, "weight-sync pause"),
          (M.REWARD_ERROR_FRAC, "failed rewards"), (M.EVAL_ERRORS, "failed eval rows")]
# Shown in red when above 0: failures a run hides otherwise (a failed reward scores 0).
ALERT_KEYS = {M.REWARD_ERROR_FRAC, M.EVAL_ERRORS}


def glance_items(glance: dict) -> list[tuple[str, str, str | None, bool]]:
    """The run page header: [(label, value, change since the start or None, alert), ...];
    ``alert`` marks a failure count above zero (drawn in red)."""
    latest, first = glance["latest"], glance["first"]
    items: list[tuple[str, str, str | None, bool]] = []
    if glance["step"] is not None and glance["total"]:
        left = max(glance["total"] - glance["step"], 0)
        step_s = latest.get(M.STEP_S)
        eta = f" · ETA {_duration(left * step_s)}" if step_s and left else ""
        items.append(("step", f"{glance['step']:,} / {glance['total']:,}{eta}", None, False))
    for key, label in GLANCE:
        if key not in latest:
            continue
        change = None
        if key in first:
            delta = latest[key] - first[key]
            change = (f"{delta * 100:+.1f} pts" if key == M.EVAL_ACCURACY else f"{delta:+.3f}")
        alert = key in ALERT_KEYS and latest[key] > 0
        items.append((label, format_metric(key, latest[key]), change, alert))
    return items


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
