from __future__ import annotations

import ast
import hashlib

from django.db import transaction

from webapp.accounts.models import Project
from webapp.config.celery import enqueue
from webapp.core.errors import ApplicationError
from webapp.rewards.models import RewardFunction, RewardFunctionVersion

MAX_SOURCE_BYTES = 200_000


def builtin_names() -> list[str]:
    from training_core.rewards.builtin import BUILTINS

    return sorted(BUILTINS)


def _check_source(source: str, entrypoint: str) -> None:
    """Static checks only (syntax, the entrypoint exists with two arguments). The code itself
    runs in a worker's sandbox."""
    if len(source.encode()) > MAX_SOURCE_BYTES:
        raise ApplicationError(f"source is larger than {MAX_SOURCE_BYTES // 1000} kB", field="source")
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ApplicationError(f"syntax error on line {exc.lineno}: {exc.msg}", field="source") from None
    except (MemoryError, RecursionError, ValueError):  # nesting the parser cannot hold; NUL bytes
        raise ApplicationError("the source is nested too deeply (or holds NUL bytes) to parse",
                               field="source") from None
    fns = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    if entrypoint not in fns:
        raise ApplicationError(f"no top-level function {entrypoint!r} in the source "
                               f"(found {sorted(fns) or 'none'})", field="entrypoint")
    if len(fns[entrypoint].args.args) < 2:
        raise ApplicationError(f"{entrypoint}(completion, item) must take two arguments",
                               field="entrypoint")


@transaction.atomic
def reward_function_create(*, project: Project, user, name: str, builtin: str | None = None,
                           source: str | None = None, entrypoint: str = "reward",
                           description: str = "") -> RewardFunctionVersion:
    if bool(builtin) == bool(source):
        raise ApplicationError("give exactly one of builtin or source", field="source")
    if builtin and builtin not in builtin_names():
        raise ApplicationError(f"unknown built-in {builtin!r}; use one of {', '.join(builtin_names())}",
                               field="builtin")
    if source:
        _check_source(source, entrypoint)
    kind = RewardFunction.Kind.BUILTIN if builtin else RewardFunction.Kind.CODE
    rf, created = RewardFunction.objects.get_or_create(
        project=project, name=name, defaults={"kind": kind, "description": description,
                                              "created_by": user})
    if not created and rf.kind != kind:
        raise ApplicationError(f"reward function {name!r} exists as {rf.kind}", field="name")
    return reward_version_create(reward_function=rf, user=user, builtin=builtin, source=source,
                                 entrypoint=entrypoint)


@transaction.atomic
def reward_version_create(*, reward_function: RewardFunction, user, builtin: str | None,
                          source: str | None, entrypoint: str) -> RewardFunctionVersion:
    body = f"{builtin or ''}\n{entrypoint}\n{source or ''}"
    checksum = hashlib.sha256(body.encode()).hexdigest()
    latest = reward_function.versions.select_for_update().first()
    if latest is not None and latest.checksum == checksum:
        return latest
    version = RewardFunctionVersion.objects.create(
        reward_function=reward_function, version=(latest.version + 1) if latest else 1,
        builtin_name=builtin or "", source=source or "", entrypoint=entrypoint, checksum=checksum,
        status=RewardFunctionVersion.Status.VALID if builtin else RewardFunctionVersion.Status.PENDING,
        created_by=user)
    if not builtin:
        transaction.on_commit(lambda: enqueue("oolong.reward_validate", version.id))
    return version


def reward_validation_record(*, version: RewardFunctionVersion, report: dict) -> RewardFunctionVersion:
    version.validation_report = report
    version.status = (RewardFunctionVersion.Status.VALID if report.get("ok")
                      else RewardFunctionVersion.Status.INVALID)
    version.save(update_fields=["validation_report", "status"])
    return version
