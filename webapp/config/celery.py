"""The Celery app. Broker and backend come from Django settings (CELERY_*): Redis in production,
a local SQLite broker that needs no server by default, an in-memory broker with no consumer in
unit tests (integration tests point it at Redis and start a real worker).

The tasks live in ``workers.tasks`` (found by name when a worker starts). The web app enqueues
them by name through :func:`enqueue` and never imports ``workers``: workers call services, services
enqueue tasks, and the dependency goes one way.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.config.settings.production")

app = Celery("oolong")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["workers"])
app.conf.beat_schedule = {
    "reconcile-runs": {"task": "oolong.runs_reconcile", "schedule": 60.0},
}


def broker_prepare() -> list[str]:
    """Declare the app's queues once, before several processes share a fresh broker; returns their names.

    Kombu's SQLAlchemy transport (the local SQLite broker) creates a queue's row on first use
    with a check-then-insert guarded by a lock of one process only. A worker and the web app
    starting together race on it, and the loser's publish fails with ``UNIQUE constraint failed:
    kombu_queue.name`` (a 500 on the request that enqueued). On Redis this is a no-op.
    """
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        for queue in app.amqp.queues.values():
            queue(channel).declare()
    return sorted(app.amqp.queues)


def enqueue(task: str, *args: Any) -> None:
    """Send ``task`` (its registered name, e.g. ``oolong.run_submit``). Call it from
    ``transaction.on_commit`` so a worker never sees an id that is not committed yet."""
    app.send_task(task, args=list(args))
