"""A password change revokes the user's API tokens (however it happens: the admin, the
``changepassword`` command, a service). Django already ends the other sessions: their auth hash
no longer matches."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db.models.signals import post_save, pre_save


def _remember_password_change(sender, instance, update_fields=None, **kwargs) -> None:
    if instance.pk is None or (update_fields is not None and "password" not in update_fields):
        instance._oolong_password_changed = False  # e.g. the last_login update of every login
        return
    old = sender.objects.filter(pk=instance.pk).values_list("password", flat=True).first()
    instance._oolong_password_changed = old is not None and old != instance.password


def _revoke_tokens(sender, instance, created=False, **kwargs) -> None:
    if getattr(instance, "_oolong_password_changed", False):
        from webapp.accounts.services import tokens_revoke_all

        tokens_revoke_all(user=instance)
        instance._oolong_password_changed = False


def connect() -> None:
    user_model = get_user_model()
    pre_save.connect(_remember_password_change, sender=user_model,
                     dispatch_uid="oolong-password-change-pre")
    post_save.connect(_revoke_tokens, sender=user_model, dispatch_uid="oolong-password-change-post")
