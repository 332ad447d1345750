"""Failed-login throttling, shared by the login page and the API token endpoint.

Only failures count, per client address: a user who types the right password is never slowed
down, a guesser gets ``LOGIN_FAILURE_LIMIT`` tries per ``LOGIN_FAILURE_WINDOW_S`` and then a 429.
Counts live in Django's cache (Redis in production, see ``DJANGO_CACHE_URL``)."""

from __future__ import annotations

from django.conf import settings
from django.core.cache import cache
from django.http import HttpRequest


def _key(request: HttpRequest) -> str:
    # The address the server saw: X-Forwarded-For is client-controlled unless a proxy sets it.
    return f"login-failures:{request.META.get('REMOTE_ADDR', '')}"


def login_blocked(request: HttpRequest) -> bool:
    return cache.get(_key(request), 0) >= settings.LOGIN_FAILURE_LIMIT


def login_failed(request: HttpRequest) -> None:
    key = _key(request)
    if cache.add(key, 1, timeout=settings.LOGIN_FAILURE_WINDOW_S):
        return
    try:
        cache.incr(key)
    except ValueError:  # expired between add and incr
        cache.add(key, 1, timeout=settings.LOGIN_FAILURE_WINDOW_S)


def retry_after_s() -> int:
    return settings.LOGIN_FAILURE_WINDOW_S
