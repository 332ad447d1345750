from __future__ import annotations

import json
from pathlib import Path

from django.db.models import Count, Max, QuerySet
from django.http import Http404

from webapp.core.errors import ApplicationError
from webapp.datasets.builtins import BUILTIN_PROMPT_TEMPLATES
from webapp.datasets.models import Dataset, DatasetVersion


def dataset_list(*, user, project_id: int | None = None) -> QuerySet[Dataset]:
    qs = (Dataset.objects.filter(project__membership__user=user)
          .select_related("project").prefetch_related("versions"))
    if project_id is not None:
        qs = qs.filter(project_id=project_id)
    return qs.annotate(version_count=Count("versions"), latest_version=Max("versions__version"))


def dataset_get(*, user, dataset_id: int) -> Dataset:
    try:
        return dataset_list(user=user).get(id=dataset_id)
    except Dataset.DoesNotExist:
        raise Http404("dataset not found") from None


def dataset_version_get(*, user, version_id: int) -> DatasetVersion:
    try:
        return DatasetVersion.objects.select_related("dataset__project").get(
            id=version_id, dataset__project__membership__user=user)
    except DatasetVersion.DoesNotExist:
        raise Http404("dataset version not found") from None


def dataset_versions_get(*, user, version_ids: list[int],
                         field: str = "eval_set_versions") -> list[DatasetVersion]:
    """The versions in the order given, each one the user may read; a 400 naming ``field`` and
    the id for any other (another project's version reads as one that does not exist)."""
    found = {v.id: v for v in DatasetVersion.objects.select_related("dataset__project").filter(
        id__in=version_ids, dataset__project__membership__user=user)}
    for version_id in version_ids:
        if version_id not in found:
            raise ApplicationError(f"dataset version {version_id} not found", field=field)
    return [found[i] for i in version_ids]


def dataset_version_list(*, dataset: Dataset) -> list[DatasetVersion]:
    """Newest first."""
    return list(dataset.versions.order_by("-version"))


def dataset_version_rows(*, version: DatasetVersion, limit: int | None = None) -> list[dict]:
    rows = []
    with Path(version.rows_path).open(encoding="utf-8") as fh:
        for line in fh:
            rows.append(json.loads(line))
            if limit is not None and len(rows) >= limit:
                break
    return rows


def dataset_version_prompt_template(*, version: DatasetVersion) -> str | None:
    """The prompt template a built-in dataset ships with; None for uploads."""
    kind, _, name = version.source.partition(":")
    return BUILTIN_PROMPT_TEMPLATES.get(name) if kind == "builtin" else None
