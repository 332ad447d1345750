"""The web side of orchestration: submit, cancel and reconcile runs through
``orchestration.trigger`` (the one orchestration module the web app imports). Called from Celery
tasks, never from a request."""

from __future__ import annotations

import logging

from django.conf import settings
from django.db import transaction

from webapp.runs.models import Run
from webapp.runs.services import (
    run_event_add,
    run_orchestrator_ref_set,
    run_status_set,
    run_token_issue,
)

log = logging.getLogger(__name__)


def run_submit_to_orchestrator(*, run_id: int) -> str | None:
    from orchestration.trigger import submit_training_run

    with transaction.atomic():
        run = Run.objects.select_for_update().get(id=run_id)
        if run.orchestrator_ref or run.status != Run.Status.QUEUED:
            return run.orchestrator_ref or None  # already submitted, or cancelled meanwhile
        provider = run.spec.get("orchestration", {}).get("provider", "local")
        # The flow's own token: only its hash stays here (rolled back if the submit fails).
        token = run_token_issue(run=run, purpose="orchestrator")
        ref = submit_training_run(run_id=run.id, tracker_url=settings.OOLONG_PUBLIC_URL,
                                  ingest_token=token, provider=provider,
                                  attempt=run.attempt)
        run_orchestrator_ref_set(run=run, ref=ref)
    run_event_add(run=run, kind="submitted", message=f"flow started ({ref})")
    return ref


def run_cancel_in_orchestrator(*, run_id: int, grace_s: float = 75.0) -> None:
    """The flow polls the cancel flag and tears down itself; if it has not ended the run after
    ``grace_s``, stop the flow process (its ``finally`` still tears down and reports).

    The grace covers the flow's own teardown: noticing the flag (a supervise poll), then, for a
    run placed across nodes, waiting up to 30 s for every node's worker to stop its process
    (``PlacedRun.stop``). Killing the flow sooner leaves the run without its final status."""
    import time

    from orchestration.trigger import flow_alive, kill_flow

    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        run = Run.objects.get(id=run_id)
        if run.status in Run.TERMINAL:
            return
        time.sleep(1.0)
    run = Run.objects.get(id=run_id)
    if run.orchestrator_ref and flow_alive(run.orchestrator_ref):
        run_event_add(run=run, kind="cancel", message="flow did not stop in time; terminating it")
        kill_flow(run.orchestrator_ref)


def runs_reconcile() -> int:
    """Fail runs whose flow is gone without reporting an end (crash, lost machine)."""
    from orchestration.trigger import flow_alive

    fixed = 0
    for run in Run.objects.exclude(status__in=Run.TERMINAL).exclude(orchestrator_ref=""):
        if flow_alive(run.orchestrator_ref) is False:
            run.refresh_from_db()
            if run.status not in Run.TERMINAL:
                run_status_set(run=run, status=Run.Status.FAILED,
                               reason=f"orchestrator lost the run ({run.orchestrator_ref} is gone)")
                fixed += 1
    return fixed
