"""The Celery app. Broker and backend come from Django settings (CELERY_*): Redis in production,
a local SQLite broker that needs no server by default."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.config.settings.local")

app = Celery("oolong")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["workers"])
app.conf.beat_schedule = {
    "reconcile-runs": {"task": "oolong.runs_reconcile", "schedule": 60.0},
}
