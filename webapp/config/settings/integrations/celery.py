"""Celery: Redis in production (CELERY_BROKER_URL); a local broker that needs no server by default."""

import os
from pathlib import Path

_DATA = Path(os.environ.get("OOLONG_DATA_DIR", Path(__file__).resolve().parents[4] / ".cache" / "webapp"))

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", f"sqla+sqlite:///{_DATA / 'celery-broker.sqlite3'}")
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND", f"db+sqlite:///{_DATA / 'celery-results.sqlite3'}")
CELERY_TASK_ALWAYS_EAGER = os.environ.get("CELERY_TASK_ALWAYS_EAGER", "0") == "1"
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
