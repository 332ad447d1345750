# Load the Celery app with Django so that tasks enqueued by the web app use its broker settings.
from webapp.config.celery import app as celery_app

__all__ = ["celery_app"]
