from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils.text import slugify
from rest_framework.authtoken.models import Token

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
    user = User.objects.create_user(username=username, password=password, email=email)
    Token.objects.create(user=user)
    return user


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


def token_get_or_create(*, user) -> str:
    return Token.objects.get_or_create(user=user)[0].key
