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
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = os.environ.get("DJANGO_SECURE_COOKIES", "1") == "1"
SECURE_HSTS_SECONDS = int(os.environ.get("DJANGO_HSTS_SECONDS", "0"))
