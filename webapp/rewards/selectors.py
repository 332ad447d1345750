from __future__ import annotations

from django.db.models import QuerySet
from django.http import Http404

from webapp.rewards.models import RewardFunction, RewardFunctionVersion


def reward_function_list(*, user, project_id: int | None = None) -> QuerySet[RewardFunction]:
    qs = (RewardFunction.objects.filter(project__membership__user=user)
          .select_related("project").prefetch_related("versions"))
    return qs.filter(project_id=project_id) if project_id is not None else qs


def reward_function_get(*, user, reward_id: int) -> RewardFunction:
    try:
        return reward_function_list(user=user).get(id=reward_id)
    except RewardFunction.DoesNotExist:
        raise Http404("reward function not found") from None


def reward_version_list(*, reward_function: RewardFunction) -> list[RewardFunctionVersion]:
    return list(reward_function.versions.all())


def reward_version_get(*, user, version_id: int) -> RewardFunctionVersion:
    try:
        return RewardFunctionVersion.objects.select_related("reward_function__project").get(
            id=version_id, reward_function__project__membership__user=user)
    except RewardFunctionVersion.DoesNotExist:
        raise Http404("reward function version not found") from None
