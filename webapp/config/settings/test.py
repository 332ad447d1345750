from webapp.config.settings.base import *  # noqa: F403
from webapp.config.settings.base import DATABASES

DEBUG = False
ALLOWED_HOSTS = ["*"]
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast test users
OOLONG_RUN_SUBMISSION = "none"
DATABASES["default"]["CONN_MAX_AGE"] = 0  # live-server threads must not hold connections open
