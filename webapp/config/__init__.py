# Load the Celery app with Django so that tasks fired by the web app use its broker settings.
from workers.celery_app import app as celery_app

__all__ = ["celery_app"]
