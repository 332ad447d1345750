"""Production: everything comes from the environment (DATABASE_URL, CELERY_BROKER_URL, ...)."""

import os

from webapp.config.settings.base import *  # noqa: F403

DEBUG = False
SECRET_KEY = os.environ["DJANGO_SECRET_KEY"]
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = os.environ.get("DJANGO_SECURE_COOKIES", "1") == "1"
