"""Production: everything comes from the environment (DATABASE_URL, CELERY_BROKER_URL, ...).

This is the default of the WSGI application and the Celery app: only ``make demo``, the tests and
``manage.py`` (a developer's tool) pick the local settings, and they say so."""

import os

from django.core.exceptions import ImproperlyConfigured

if not os.environ.get("DJANGO_SECRET_KEY"):
    raise ImproperlyConfigured(
        "DJANGO_SECRET_KEY is not set: production needs a secret key of its own (for example "
        "`python -c 'import secrets; print(secrets.token_urlsafe(50))'`); for a local try-out set "
        "DJANGO_SETTINGS_MODULE=webapp.config.settings.local")

from webapp.config.settings.base import *  # noqa: E402,F403

DEBUG = False


def _flag(name: str, default: str) -> bool:
    return os.environ.get(name, default) == "1"


# HTTPS only: cookies never travel in clear, plain HTTP is redirected, browsers remember for a
# year. Behind a proxy that terminates TLS, DJANGO_SECURE_PROXY_SSL_HEADER=1 trusts its
# X-Forwarded-Proto (only then: a client could send the header itself). A plain-HTTP trial on
# loopback sets DJANGO_SECURE_SSL_REDIRECT=0 and DJANGO_SECURE_COOKIES=0.
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = _flag("DJANGO_SECURE_COOKIES", "1")
SECURE_SSL_REDIRECT = _flag("DJANGO_SECURE_SSL_REDIRECT", "1")
SECURE_HSTS_SECONDS = int(os.environ.get("DJANGO_HSTS_SECONDS", str(365 * 24 * 3600)))
SECURE_HSTS_INCLUDE_SUBDOMAINS = _flag("DJANGO_HSTS_INCLUDE_SUBDOMAINS", "0")
if _flag("DJANGO_SECURE_PROXY_SSL_HEADER", "0"):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SESSION_COOKIE_HTTPONLY = True

# The login throttle counts in the cache: every web process must see the same counts, so a
# process-local cache is refused (see base.CACHES).
if CACHES["default"]["BACKEND"].endswith("LocMemCache"):  # noqa: F405
    raise ImproperlyConfigured(
        "DJANGO_CACHE_URL is not set: production needs a cache shared by every web process (the "
        "login throttle counts failures in it), e.g. DJANGO_CACHE_URL=redis://127.0.0.1:6379/2")

# Prefect in server mode: authenticated, and no token in a flow parameter (integrations/prefect.py).
_prefect_missing = prefect_server_missing()  # noqa: F405
if _prefect_missing:
    raise ImproperlyConfigured(
        f"OOLONG_PREFECT_MODE=server needs {', '.join(_prefect_missing)}: the Prefect server "
        "requires authentication (PREFECT_SERVER_API_AUTH_STRING=user:password on the server, "
        "PREFECT_API_AUTH_STRING the same on every client) and flows get their token sealed with "
        "OOLONG_CONTROL_KEY (`python -m orchestration.sealing` makes one; the flows' worker needs "
        "the same); see docs/orchestration.md")
