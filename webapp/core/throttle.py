"""Failed-login throttling, shared by the login page and the API token endpoint.

Failures are counted per (username, client address) pair, in Django's cache (Redis in
production: the production settings refuse a process-local cache). After
``LOGIN_FAILURE_LIMIT`` failures in ``LOGIN_FAILURE_WINDOW_S`` that pair gets a 429 without a
password check. Nobody else is affected: a guesser at one address cannot lock a user out of
their own address, and failures for one username never block another. A correct password always
goes through from any pair that is not itself throttled, and a success clears its pair.

The client address is the connection's, unless the connection comes from a proxy listed in
``TRUSTED_PROXIES`` (OOLONG_TRUSTED_PROXIES): then it is the last X-Forwarded-For address that
is not one of those proxies. Behind an unlisted proxy every client would share the proxy's
address (still per username); a client-sent X-Forwarded-For is never believed otherwise.
"""

from __future__ import annotations

import hashlib
import ipaddress
from functools import lru_cache

from django.conf import settings
from django.core.cache import cache
from django.http import HttpRequest


@lru_cache(maxsize=8)
def _networks(proxies: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(p, strict=False) for p in proxies)


def _trusted(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in _networks(tuple(settings.TRUSTED_PROXIES)))


def client_address(request: HttpRequest) -> str:
    """The client's address, believing X-Forwarded-For only from trusted proxies."""
    address = request.META.get("REMOTE_ADDR", "")
    if not settings.TRUSTED_PROXIES or not _trusted(address):
        return address
    forwarded = [a.strip() for a in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")]
    for hop in reversed([a for a in forwarded if a]):  # the proxies append: read from the end
        if not _trusted(hop):
            return hop[:64]
    return address


def _key(request: HttpRequest, username: str) -> str:
    # Usernames are client text of any length: hashed into the key, case-folded as people type
    # them (Django's usernames are case-sensitive, so this may count two users' failures
    # together; it never lets a variant dodge the count).
    who = hashlib.sha256(f"{username.casefold()}\0{client_address(request)}".encode()).hexdigest()
    return f"login-failures:{who}"


def login_blocked(request: HttpRequest, username: str) -> bool:
    return cache.get(_key(request, username), 0) >= settings.LOGIN_FAILURE_LIMIT


def login_failed(request: HttpRequest, username: str) -> None:
    key = _key(request, username)
    if cache.add(key, 1, timeout=settings.LOGIN_FAILURE_WINDOW_S):
        return
    try:
        cache.incr(key)
    except ValueError:  # expired between add and incr
        cache.add(key, 1, timeout=settings.LOGIN_FAILURE_WINDOW_S)


def login_succeeded(request: HttpRequest, username: str) -> None:
    cache.delete(_key(request, username))


def retry_after_s() -> int:
    return settings.LOGIN_FAILURE_WINDOW_S
