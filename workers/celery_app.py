"""The worker's entry point: ``celery -A workers.celery_app worker``. The app itself is defined with
the web app's settings in ``webapp.config.celery``; its tasks are in ``workers.tasks``."""

from webapp.config.celery import app

__all__ = ["app"]
