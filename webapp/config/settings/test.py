from webapp.config.settings.base import *  # noqa: F403
from webapp.config.settings.base import DATABASES

DEBUG = False
ALLOWED_HOSTS = ["*"]
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast test users
# Tasks the web app enqueues go to an in-memory broker that no worker reads: unit tests see the
# enqueue, nothing runs. Integration tests point the app at Redis and start a real worker.
CELERY_BROKER_URL = "memory://"
CELERY_RESULT_BACKEND = "cache+memory://"
DATABASES["default"]["CONN_MAX_AGE"] = 0  # live-server threads must not hold connections open
SERIES_CACHE_S = 0  # tests read what they just wrote; the cache has tests of its own
