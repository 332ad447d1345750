"""Celery tasks: thin, idempotent, ids in, one service call each (imported inside the body so a
worker starts fast and the web app can import this module cheaply)."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django.db import OperationalError


# acks_late with reject_on_worker_lost: a worker killed inside the submission (OOM, a node
# lost) puts the message back instead of acknowledging it, and the next worker submits. Safe
# because the task is idempotent; runs_reconcile sends again whatever is still lost.
@shared_task(name="oolong.run_submit", bind=True, max_retries=5, default_retry_delay=5,
             autoretry_for=(OperationalError, ConnectionError), retry_backoff=True,
             acks_late=True, reject_on_worker_lost=True)
def run_submit(self, run_id: int) -> str | None:
    """Start the run's Prefect flow. Safe to run twice: a run already submitted is left alone,
    and a flow a killed worker started is found again, not started twice."""
    from webapp.runs.orchestration import run_submit_to_orchestrator

    return run_submit_to_orchestrator(run_id=run_id)


@shared_task(name="oolong.run_cancel", bind=True, max_retries=5, default_retry_delay=2,
             autoretry_for=(OperationalError, ConnectionError), retry_backoff=True)
def run_cancel(self, run_id: int) -> None:
    from webapp.runs.orchestration import run_cancel_in_orchestrator

    run_cancel_in_orchestrator(run_id=run_id)


@shared_task(name="oolong.runs_reconcile")
def runs_reconcile() -> int:
    """Periodic: runs the orchestrator lost (crashed flows, lost workers) are failed with a reason."""
    from webapp.runs.orchestration import runs_reconcile as reconcile

    return reconcile()


# Hard ceilings on top of the jail's own deadlines (validation: 10 s of calls plus start-up;
# scoring: the trainer's reward.timeout_s): a worker child wedged outside the jail is killed.
REWARD_VALIDATE_LIMITS = {"soft_time_limit": 120, "time_limit": 150}
REWARD_SCORE_LIMITS = {"soft_time_limit": 300, "time_limit": 330}


@shared_task(name="oolong.reward_validate", acks_late=True, **REWARD_VALIDATE_LIMITS)
def reward_validate(version_id: int) -> dict:
    """Run user reward code in the sandbox against sample rows and record the report."""
    from webapp.rewards.validation import reward_version_validate

    return reward_version_validate(version_id=version_id)


@shared_task(name="oolong.reward_score", acks_late=True, **REWARD_SCORE_LIMITS)
def reward_score(fn_path: str, source: str, completion: str, item: dict[str, Any],
                 extract: str = "auto", timeout_s: float = 10.0, memory_mb: int | None = None) -> dict:
    """The remote reward backend: trainers fan expensive rewards out to this worker pool, with
    the run's reward.timeout_s and reward.memory_mb (tasks sent before they travelled: the
    defaults)."""
    from webapp.rewards.validation import reward_score_remote

    return reward_score_remote(fn_path=fn_path, source=source, completion=completion, item=item,
                               extract=extract, timeout_s=timeout_s, memory_mb=memory_mb)


@shared_task(name="oolong.dataset_validate")
def dataset_validate(version_id: int) -> dict:
    """Re-check a stored dataset version against its task schema (e.g. after a schema change)."""
    from webapp.datasets.services import dataset_version_revalidate

    return dataset_version_revalidate(version_id=version_id)


@shared_task(name="oolong.evaluation_run", acks_late=True)
def evaluation_run(run_id: int, checkpoint_step: int | None = None, limit: int = 200) -> dict:
    """Score a run's checkpoint offline on held-out rows of its dataset (greedy accuracy)."""
    from webapp.tracking.evaluation import checkpoint_evaluate

    return checkpoint_evaluate(run_id=run_id, checkpoint_step=checkpoint_step, limit=limit)


# Exports write a model's folder (seconds for SmolLM2, minutes for a 7B): no time limit beyond
# the worker's; acks_late so a killed worker's export runs again (the service is idempotent).
@shared_task(name="oolong.model_export", acks_late=True, reject_on_worker_lost=True,
             autoretry_for=(OperationalError,), max_retries=3, retry_backoff=True)
def model_export(model_version_id: int) -> dict:
    """Export a run's version as a Hugging Face folder into the store and register it."""
    from webapp.registry.services import model_version_export

    return model_version_export(model_version_id=model_version_id)
