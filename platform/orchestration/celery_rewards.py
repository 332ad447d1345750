"""Remote rewards on the Celery worker pool, for expensive rewards (code execution, model judges).

Select with ``reward.executor: remote`` (the default ``reward.remote_backend`` is this class).
The trainer only needs the broker: OOLONG_REWARD_BROKER_URL and OOLONG_REWARD_RESULT_BACKEND
(fall back to CELERY_BROKER_URL / CELERY_RESULT_BACKEND). Tasks are sent by name, so nothing of
the web app is imported on the trainer's side.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from celery import Celery

TASK = "oolong.reward_score"
RESULT_MARGIN_S = 10.0  # the queue, the jail's start and the way back, on top of reward.timeout_s
WORKER_DEFAULT_TIMEOUT_S = 10.0  # what workers/tasks.reward_score runs a call under without one


class CeleryRewardBackend:
    def __init__(self, fn_path: str, *, timeout_s: float = 30.0, extract: str = "auto",
                 source: str | None = None, memory_mb: int | None = None):
        broker = os.environ.get("OOLONG_REWARD_BROKER_URL") or os.environ.get("CELERY_BROKER_URL")
        backend = os.environ.get("OOLONG_REWARD_RESULT_BACKEND") or os.environ.get("CELERY_RESULT_BACKEND")
        if not broker or not backend:
            raise ValueError("reward.executor 'remote' needs OOLONG_REWARD_BROKER_URL and "
                             "OOLONG_REWARD_RESULT_BACKEND (the Celery broker and result backend)")
        self.fn_path = fn_path
        self.timeout_s = timeout_s
        self.extract = extract
        self.memory_mb = memory_mb
        # User reward code travels with the task (workers have no copy of the run directory); the
        # pool has read it already.
        self.source = source or ""
        self.app = Celery("oolong-trainer", broker=broker, backend=backend)

    async def score(self, completion: str, item: dict[str, Any]) -> tuple[float, str | None]:
        # The worker's jail enforces the deadline and the memory; waiting a little longer here
        # lets its answer (a timeout, a MemoryError) arrive instead of a wait of our own expiring,
        # and a task still queued when we stop waiting is dropped, not run for no one. The two
        # travel only where they differ from what a worker assumes without them, so a worker
        # older than them still serves runs that keep the defaults.
        kwargs: dict[str, Any] = {"extract": self.extract}
        if self.timeout_s != WORKER_DEFAULT_TIMEOUT_S:
            kwargs["timeout_s"] = self.timeout_s
        if self.memory_mb is not None:
            kwargs["memory_mb"] = self.memory_mb
        wait = self.timeout_s + RESULT_MARGIN_S
        result = self.app.send_task(TASK, args=[self.fn_path, self.source, completion, item],
                                    kwargs=kwargs, expires=wait)
        body = await asyncio.to_thread(result.get, timeout=wait, propagate=True)
        return float(body.get("reward", 0.0)), body.get("error")

    def close(self) -> None:
        self.app.close()
