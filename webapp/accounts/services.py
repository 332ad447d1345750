from __future__ import annotations

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from django.utils.text import slugify

from webapp.accounts.models import Membership, Project
from webapp.core.errors import ApplicationError


@transaction.atomic
def user_create(*, username: str, password: str, email: str = ""):
    User = get_user_model()
    if User.objects.filter(username=username).exists():
        raise ApplicationError("username is taken", field="username")
    try:
        validate_password(password, User(username=username, email=email))
    except ValidationError as exc:
        raise ApplicationError(" ".join(exc.messages), field="password") from None
    return User.objects.create_user(username=username, password=password, email=email)


@transaction.atomic
def project_create(*, user, name: str, slug: str | None = None) -> Project:
    """Slugs are one namespace (like usernames). A slug derived from the name takes the first
    free ``name``, ``name-2``, ...; only a slug asked for explicitly can be "not available"."""
    if slug is None:
        base = slugify(name)[:90]
        if not base:
            raise ApplicationError("name must contain letters or digits", field="name")
        taken = set(Project.objects.filter(slug__startswith=base).values_list("slug", flat=True))
        slug = next(s for s in (base, *(f"{base}-{i}" for i in range(2, len(taken) + 3)))
                    if s not in taken)
    elif Project.objects.filter(slug=slug).exists():
        raise ApplicationError(f"slug {slug!r} is not available; choose another or leave it out",
                               field="slug", status_code=409)
    project = Project.objects.create(name=name, slug=slug)
    Membership.objects.create(user=user, project=project, role=Membership.Role.OWNER)
    return project


def membership_add(*, project: Project, user, role: str = Membership.Role.MEMBER) -> Membership:
    membership, _ = Membership.objects.get_or_create(project=project, user=user,
                                                     defaults={"role": role})
    return membership


@transaction.atomic
def token_create(*, user) -> tuple[str, object]:
    """A new API token for ``user``: (the plaintext, shown once; its AuthToken row, which keeps
    only a digest, the key prefix and the expiry). Expired tokens go; past
    ``API_TOKENS_PER_USER`` live ones, the oldest go too."""
    from knox.models import AuthToken

    AuthToken.objects.filter(user=user, expiry__lt=timezone.now()).delete()
    keep = settings.API_TOKENS_PER_USER - 1
    stale = list(AuthToken.objects.filter(user=user).order_by("-created")
                 .values_list("digest", flat=True)[keep:])
    if stale:
        AuthToken.objects.filter(digest__in=stale).delete()
    instance, token = AuthToken.objects.create(user=user)
    return token, instance


def token_get_or_create(*, user) -> str:
    """A usable API token for ``user`` (the CLI's ``manage.py oolong_user``, tests). Tokens are
    stored as digests, so this always makes a new one."""
    return token_create(user=user)[0]


def token_revoke(*, user, token_key: str) -> None:
    """Revoke the owner's token(s) whose key prefix (``token_key``, as listed) matches."""
    from knox.models import AuthToken

    deleted, _ = AuthToken.objects.filter(user=user, token_key=token_key).delete()
    if not deleted:
        raise ApplicationError("no token of yours has this key", field="token_key",
                               status_code=404)


def tokens_revoke_all(*, user) -> int:
    from knox.models import AuthToken

    return AuthToken.objects.filter(user=user).delete()[0]


def project_quota_set(*, user, project: Project, values: dict) -> None:
    """Set a project's maxima (``max_servers``, ...; None: back to the site default). Site
    administrators only: members get a 403."""
    from webapp.accounts.models import ProjectQuota
    from webapp.accounts.selectors import QUOTA_FIELDS

    if not getattr(user, "is_staff", False):
        raise ApplicationError("only administrators set a project's quota", field=None,
                               status_code=403)
    unknown = sorted(set(values) - set(QUOTA_FIELDS))
    if unknown:
        raise ApplicationError(f"unknown quota field(s) {unknown}", field=unknown[0])
    quota, _ = ProjectQuota.objects.get_or_create(project=project)
    for name, value in values.items():
        setattr(quota, name, value)
    quota.save()
