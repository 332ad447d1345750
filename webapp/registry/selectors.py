from __future__ import annotations

from django.db.models import QuerySet
from django.http import Http404

from training_core import metric_names as M
from webapp.registry.models import ModelAlias, ModelVersion
from webapp.runs.models import Run
from webapp.tracking.models import MetricPoint


def model_version_list(*, user, project_id: int | None = None, run_id: int | None = None,
                       name: str | None = None, alias: str | None = None,
                       status: str | None = None) -> QuerySet[ModelVersion]:
    """The model versions of the user's projects (the runs' rule: membership), newest first."""
    qs = (ModelVersion.objects.filter(project__membership__user=user)
          .select_related("run", "dataset_version__dataset", "reward_version__reward_function")
          .prefetch_related("aliases"))
    if project_id is not None:
        qs = qs.filter(project_id=project_id)
    if run_id is not None:
        qs = qs.filter(run_id=run_id)
    if name:
        qs = qs.filter(name=name)
    if alias:
        qs = qs.filter(aliases__name=alias)
    if status:
        qs = qs.filter(status=status)
    return qs


def model_version_get(*, user, model_version_id: int) -> ModelVersion:
    try:
        return model_version_list(user=user).get(id=model_version_id)
    except ModelVersion.DoesNotExist:
        raise Http404("model version not found") from None


def model_alias_list(*, model_version: ModelVersion) -> list[str]:
    return [a.name for a in model_version.aliases.all()]


def project_alias_list(*, project_id: int) -> QuerySet[ModelAlias]:
    return ModelAlias.objects.filter(project_id=project_id).select_related("model_version")


def run_evaluations(*, run: Run) -> dict[int, dict[str, float]]:
    """version -> the held-out metrics (``eval/*``) the tracker recorded at it: a step's version
    is its ``version`` metric (what training_core.export ranks ``best`` by)."""
    points = list(MetricPoint.objects.filter(run=run).filter(key__startswith="eval/").values_list(
        "step", "key", "value"))
    version_at = dict(MetricPoint.objects.filter(run=run, key=M.VERSION).values_list("step", "value"))
    version_at.setdefault(0, 0.0)  # the evaluation before training is version 0's
    # the version the evaluation itself recorded wins over the step's (issue 48's harness)
    taken_at = {step: value for step, key, value in points if key == M.EVAL_HELDOUT["version"]}
    out: dict[int, dict[str, float]] = {}
    for step, key, value in points:
        version = taken_at.get(step, version_at.get(step))
        if version is not None:
            out.setdefault(int(version), {})[key] = value
    return out


def run_step_versions(*, run: Run) -> dict[int, int]:
    """step -> the policy version after it, as the tracker recorded it (the run directory's
    metrics.jsonl says the same; the web app reads its own record)."""
    found = MetricPoint.objects.filter(run=run, key=M.VERSION).values_list("step", "value")
    return {0: 0, **{int(step): int(value) for step, value in found}}
