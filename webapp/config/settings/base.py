"""Settings shared by every environment. Production differs only through environment variables."""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parents[3]
DATA_DIR = Path(os.environ.get("OOLONG_DATA_DIR", BASE_DIR / ".cache" / "webapp"))

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "dev-only-insecure-key-change-me")
DEBUG = os.environ.get("DJANGO_DEBUG", "0") == "1"
ALLOWED_HOSTS = [h for h in os.environ.get("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost").split(",") if h]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "webapp.accounts",
    "webapp.datasets",
    "webapp.rewards",
    "webapp.runs",
    "webapp.tracking",
    "webapp.dashboard",
    "webapp.api",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "webapp.config.urls"
WSGI_APPLICATION = "webapp.config.wsgi.application"

TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "DIRS": [BASE_DIR / "webapp" / "templates"],
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]

# SQLite file by default (a fresh machine needs no server); PostgreSQL via DATABASE_URL.
DATABASES = {"default": dj_database_url.config(
    default=f"sqlite:///{DATA_DIR / 'db.sqlite3'}", conn_max_age=60)}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    DATABASES["default"].setdefault("OPTIONS", {})["timeout"] = 30

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
AUTH_PASSWORD_VALIDATORS = [{"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"}]
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = DATA_DIR / "static"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # whitenoise warns about a missing root
MEDIA_ROOT = Path(os.environ.get("OOLONG_MEDIA_ROOT", DATA_DIR / "media"))
WHITENOISE_USE_FINDERS = True
# plotly.js comes from the plotly package itself: served locally, no CDN.
import plotly as _plotly  # noqa: E402

STATICFILES_DIRS = [("plotly", str(Path(_plotly.__file__).parent / "package_data"))]  # serve app static (plotly.js) without collectstatic in dev

LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

# Uploads: reject early and clearly instead of filling the disk.
DATASET_MAX_UPLOAD_BYTES = int(os.environ.get("OOLONG_DATASET_MAX_UPLOAD_MB", "50")) * 1024 * 1024
DATA_UPLOAD_MAX_MEMORY_SIZE = 10 * 1024 * 1024
FILE_UPLOAD_MAX_MEMORY_SIZE = 5 * 1024 * 1024

from webapp.config.settings.integrations.celery import *  # noqa: E402,F403
from webapp.config.settings.integrations.drf import *  # noqa: E402,F403
from webapp.config.settings.integrations.prefect import *  # noqa: E402,F403
