"""Settings shared by every environment. Production differs only through environment variables."""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parents[3]
DATA_DIR = Path(os.environ.get("OOLONG_DATA_DIR", BASE_DIR / ".cache" / "webapp"))



def _secret_key() -> str:
    """DJANGO_SECRET_KEY, or (development and tests only: production requires the variable) a
    random key made once per machine and kept in DATA_DIR, readable by its owner only."""
    if os.environ.get("DJANGO_SECRET_KEY"):
        return os.environ["DJANGO_SECRET_KEY"]
    path = DATA_DIR / "secret_key"
    if not path.exists():
        import secrets

        DATA_DIR.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(50))
        os.replace(tmp, path)  # concurrent first starts: the last writer wins, all read one key
    return path.read_text().strip()


SECRET_KEY = _secret_key()
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
    "knox",  # user API tokens, hashed, with expiry (webapp.accounts.auth)
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "webapp.accounts",
    "webapp.datasets",
    "webapp.rewards",
    "webapp.runs",
    "webapp.sweeps",
    "webapp.tracking",
    "webapp.registry",
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
    "webapp.core.middleware.ContentSecurityPolicyMiddleware",
]

# Scripts only from our origin (no inline script, no eval); plotly and Swagger UI inject
# <style> elements, so styles may be inline. Nothing may frame the dashboard.
CONTENT_SECURITY_POLICY = {
    "default-src": ["'self'"],
    "script-src": ["'self'"],
    "style-src": ["'self'", "'unsafe-inline'"],
    "img-src": ["'self'", "data:"],
    "font-src": ["'self'", "data:"],
    "connect-src": ["'self'"],
    "object-src": ["'none'"],
    "base-uri": ["'self'"],
    "form-action": ["'self'"],
    "frame-ancestors": ["'none'"],
}

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
AUTH_PASSWORD_VALIDATORS = [{"NAME": f"django.contrib.auth.password_validation.{name}"} for name in (
    "UserAttributeSimilarityValidator", "MinimumLengthValidator", "CommonPasswordValidator",
    "NumericPasswordValidator")]
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

# Failed logins (page and API token endpoint) per username and client address, counted in the
# cache (webapp.core.throttle).
LOGIN_FAILURE_LIMIT = int(os.environ.get("OOLONG_LOGIN_FAILURE_LIMIT", "10"))
LOGIN_FAILURE_WINDOW_S = 300
# Proxies whose X-Forwarded-For names the client (addresses or networks, comma separated): only
# requests from these have the header believed. Empty: the connection's address is the client.
TRUSTED_PROXIES = [p.strip() for p in os.environ.get("OOLONG_TRUSTED_PROXIES", "").split(",")
                   if p.strip()]

# User API tokens: digests only, an expiry, at most API_TOKENS_PER_USER live per user (a new one
# replaces the oldest: every request checks the user's tokens for expiry).
from datetime import timedelta  # noqa: E402

REST_KNOX = {"TOKEN_TTL": timedelta(days=int(os.environ.get("OOLONG_API_TOKEN_TTL_DAYS", "30"))),
             "AUTO_REFRESH": False}
API_TOKENS_PER_USER = int(os.environ.get("OOLONG_API_TOKENS_PER_USER", "20"))
# One cache for every web process in production (the throttle counts must be shared).
CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                      "LOCATION": os.environ["DJANGO_CACHE_URL"]}
          if os.environ.get("DJANGO_CACHE_URL") else
          {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

# Chart reads (a run's series for given keys and buckets) are shared from the cache for this many
# seconds: viewers of the same live runs (the run pages' 3 s refresh, the compare view) then cost
# the database one read per run and interval, not one per viewer. A chart is at most this much
# older than the database; 0 reads every time.
SERIES_CACHE_S = float(os.environ.get("OOLONG_SERIES_CACHE_S", "3"))

# What a project's members may ask of the machines when an administrator set nothing else for
# the project (Django admin, Project > quota): a fresh project cannot start 500 rollout servers.
PROJECT_QUOTA_DEFAULTS = {
    name: int(os.environ.get(f"OOLONG_QUOTA_{name.upper()}", default)) for name, default in (
        ("max_servers", "4"), ("max_reward_workers", "8"), ("max_concurrent", "1024"),
        ("max_new_tokens", "4096"), ("max_steps", "100000"), ("max_model_params", "50000000"))}

# What one run may store through the ingest API, and how fast one run token may call it (issue
# 47: a run token stored 42 MB in 2.4 s with no bound). Past a bound, ingest keeps what fits and
# says what it dropped (one ingest_limit event per kind); past the rate, a 429 with Retry-After.
INGEST_MAX_TRAJECTORIES = int(os.environ.get("OOLONG_INGEST_MAX_TRAJECTORIES", "200000"))
INGEST_MAX_TRAJECTORY_BYTES = int(os.environ.get("OOLONG_INGEST_MAX_TRAJECTORY_MB", "1024")) << 20
INGEST_MAX_METRIC_KEYS = int(os.environ.get("OOLONG_INGEST_MAX_METRIC_KEYS", "2000"))
INGEST_MAX_EVENTS = int(os.environ.get("OOLONG_INGEST_MAX_EVENTS", "100000"))
INGEST_RATE_PER_S = float(os.environ.get("OOLONG_INGEST_RATE_PER_S", "20"))

LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

# Uploads: reject early and clearly instead of filling the disk.
DATASET_MAX_UPLOAD_BYTES = int(os.environ.get("OOLONG_DATASET_MAX_UPLOAD_MB", "50")) * 1024 * 1024
# Parsing happens in a child process with its own memory limit (webapp.datasets.validation).
DATASET_MAX_ROWS = int(os.environ.get("OOLONG_DATASET_MAX_ROWS", "1000000"))
DATASET_MAX_DECOMPRESSED_BYTES = int(os.environ.get("OOLONG_DATASET_MAX_DECOMPRESSED_MB", "512")) << 20
DATASET_PARSE_MEMORY_BYTES = int(os.environ.get("OOLONG_DATASET_PARSE_MEMORY_MB", "1536")) << 20
# One field of one row (a question, an answer, any extra column), in characters.
DATASET_MAX_CELL_CHARS = int(os.environ.get("OOLONG_DATASET_MAX_CELL_CHARS", "131072"))
DATA_UPLOAD_MAX_MEMORY_SIZE = 10 * 1024 * 1024
FILE_UPLOAD_MAX_MEMORY_SIZE = 5 * 1024 * 1024
FILE_UPLOAD_HANDLERS = [
    "webapp.core.uploads.CappedUploadHandler",  # first: stops a stream over the cap mid-read
    "django.core.files.uploadhandler.MemoryFileUploadHandler",
    "django.core.files.uploadhandler.TemporaryFileUploadHandler",
]

from webapp.config.settings.integrations.celery import *  # noqa: E402,F403
from webapp.config.settings.integrations.drf import *  # noqa: E402,F403
from webapp.config.settings.integrations.prefect import *  # noqa: E402,F403
