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



# ProjectQuota's field for each spec field it bounds.
QUOTA_FIELDS = {"max_servers": "rollout.num_servers", "max_reward_workers": "reward.workers",
                "max_concurrent": "rollout.max_concurrent",
                "max_new_tokens": "rollout.max_new_tokens", "max_steps": "trainer.steps",
                "max_model_params": "model"}


def project_quota_limits(*, project: Project) -> dict[str, int]:
    """The project's maxima (``max_servers``, ...): its own where an administrator set them,
    the site defaults elsewhere."""
    from django.conf import settings

    from webapp.accounts.models import ProjectQuota

    limits = dict(settings.PROJECT_QUOTA_DEFAULTS)
    quota = ProjectQuota.objects.filter(project=project).first()
    if quota is not None:
        limits.update({name: getattr(quota, name) for name in QUOTA_FIELDS
                       if getattr(quota, name) is not None})
    return limits


def token_list(*, user):
    """The user's live API tokens, newest first (digests are never shown; ``token_key`` is the
    plaintext's first characters, enough to tell tokens apart)."""
    from django.db.models import Q
    from django.utils import timezone
    from knox.models import AuthToken

    return (AuthToken.objects.filter(user=user)
            .filter(Q(expiry__isnull=True) | Q(expiry__gte=timezone.now())).order_by("-created"))
