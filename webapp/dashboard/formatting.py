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
