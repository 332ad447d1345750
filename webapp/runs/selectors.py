from __future__ import annotations

import hmac
from typing import Any

from django.db.models import QuerySet
from django.http import Http404

from webapp.runs.models import Run, RunEvent, RunToken, token_hash


def run_list(*, user, project_id: int | None = None, status: str | None = None,
             search: str | None = None) -> QuerySet[Run]:
    qs = Run.objects.filter(project__membership__user=user).select_related(
        "project", "dataset_version__dataset", "reward_version__reward_function")
    if project_id is not None:
        qs = qs.filter(project_id=project_id)
    if status:
        qs = qs.filter(status=status)
    if search:
        qs = qs.filter(name__icontains=search)
    return qs


def run_get(*, user, run_id: int) -> Run:
    try:
        return run_list(user=user).get(id=run_id)
    except Run.DoesNotExist:
        raise Http404("run not found") from None


def run_event_list(*, run: Run, after: int = 0, limit: int = 500) -> QuerySet[RunEvent]:
    """The run's events after event id ``after``, oldest first (the live event log polls this)."""
    return run.events.filter(id__gt=after).order_by("id")[:limit]


def run_event_recent(*, run: Run, limit: int = 100) -> list[RunEvent]:
    """The newest events first (the run page's event log)."""
    return list(run.events.order_by("-id")[:limit])


def run_get_by_ingest_token(*, token: str) -> Run | None:
    """The run an ingest token belongs to; None for an unknown or revoked token, or a run that has
    ended (its tokens stop working with it)."""
    digest = token_hash(token)
    found = (RunToken.objects.select_related("run", "run__reward_version")
             .filter(token_hash=digest, revoked_at__isnull=True).first())
    if found is None or not hmac.compare_digest(found.token_hash, digest):
        return None
    return None if found.run.status in Run.TERMINAL else found.run


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name))
        else:
            out[name] = value
    return out


def run_config_diff(*, runs: list[Run]) -> list[dict[str, Any]]:
    """Rows of (key, value per run, differs) over the flattened specs, differing keys first."""
    flats = [_flatten(r.spec) for r in runs]
    keys = sorted(set().union(*flats)) if flats else []
    rows = []
    for key in keys:
        values = [f.get(key) for f in flats]
        rows.append({"key": key, "values": values,
                     "differs": any(v != values[0] for v in values[1:])})
    return sorted(rows, key=lambda r: (not r["differs"], r["key"]))
