from webapp.config.settings.base import *  # noqa: F403

DEBUG = True
ALLOWED_HOSTS = ["*"]
