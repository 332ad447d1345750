from __future__ import annotations

from django.db.models import QuerySet
from django.http import Http404

from webapp.accounts.models import Project


def project_list(*, user) -> QuerySet[Project]:
    return Project.objects.filter(membership__user=user).order_by("name")


def project_get_for_user(*, user, project_id: int | None = None, slug: str | None = None) -> Project:
    """The one place that decides access: a project the user is not a member of does not exist
    for them (404, never 403, so ids of other projects leak nothing)."""
    qs = project_list(user=user)
    try:
        return qs.get(id=project_id) if project_id is not None else qs.get(slug=slug)
    except Project.DoesNotExist:
        raise Http404("project not found") from None

