"""How the run page shows a metric: grouped by namespace, integers as integers, units on times,
rates and fractions."""

from __future__ import annotations

GROUP_ORDER = ["reward", "eval", "staleness", "rollout", "loss", "tokens", "time", "proximal"]
LOSS_KEYS = {"loss", "kl", "grad_norm", "clip_frac", "version", "tokens_per_s"}


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


GLANCE = [("reward/mean", "reward"), ("eval/accuracy", "eval accuracy"),
          ("tokens_per_s", "tokens/s"), ("staleness/mean", "staleness mean"),
          ("staleness/max", "staleness max"), ("time/weight_sync_pause_s", "weight-sync pause")]


def glance_items(glance: dict) -> list[tuple[str, str, str | None]]:
    """The run page header: [(label, value, change since the start or None), ...]."""
    latest, first = glance["latest"], glance["first"]
    items: list[tuple[str, str, str | None]] = []
    if glance["step"] is not None and glance["total"]:
        left = max(glance["total"] - glance["step"], 0)
        step_s = latest.get("time/step_s")
        eta = f" · ETA {_duration(left * step_s)}" if step_s and left else ""
        items.append(("step", f"{glance['step']:,} / {glance['total']:,}{eta}", None))
    for key, label in GLANCE:
        if key not in latest:
            continue
        change = None
        if key in first:
            delta = latest[key] - first[key]
            change = (f"{delta * 100:+.1f} pts" if key == "eval/accuracy" else f"{delta:+.3f}")
        items.append((label, format_metric(key, latest[key]), change))
    return items


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
