from __future__ import annotations

from django.db.models import Prefetch, QuerySet
from django.http import Http404

from webapp.runs.models import Run
from webapp.sweeps.models import Sweep


def sweep_list(*, user, project_id: int | None = None, with_runs: bool = False) -> QuerySet[Sweep]:
    """The user's sweeps, newest first; ``with_runs`` reads their runs too (``sweep.runs.all``,
    in creation order) in one more query."""
    qs = Sweep.objects.filter(project__membership__user=user).select_related("project")
    if project_id is not None:
        qs = qs.filter(project_id=project_id)
    if with_runs:
        qs = qs.prefetch_related(Prefetch("runs", queryset=Run.objects.order_by("id")))
    return qs


def sweep_get(*, user, sweep_id: int) -> Sweep:
    try:
        return sweep_list(user=user).get(id=sweep_id)
    except Sweep.DoesNotExist:
        raise Http404("sweep not found") from None


def sweep_runs(*, sweep: Sweep) -> list[Run]:
    """The sweep's runs in the order of its combinations (creation order)."""
    return list(sweep.runs.select_related("project").order_by("id"))
