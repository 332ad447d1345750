"""The web side of orchestration: submit, cancel and reconcile runs through
``orchestration.trigger`` (the one orchestration module the web app imports). Called from Celery
tasks, never from a request."""

from __future__ import annotations

import logging

from django.conf import settings
from django.db import transaction

from webapp.runs.models import Run
from webapp.runs.selectors import run_spec_resolved
from webapp.runs.services import (
    run_event_add,
    run_orchestrator_ref_set,
    run_status_set,
    run_token_issue,
)

log = logging.getLogger(__name__)


def run_submit_to_orchestrator(*, run_id: int) -> str | None:
    """Start the run's flow; safe to run twice, and after a worker killed in the middle (the
    task is ``acks_late``: its message comes back). The flow's token is committed before the
    orchestrator is called, so a flow started by a killed worker holds a valid token, and the
    orchestrator call itself is idempotent per (run, attempt): Prefect's idempotency key, the
    local mode's pid file. A retry finds that flow instead of starting a second."""
    from orchestration.trigger import submit_training_run

    with transaction.atomic():
        run = Run.objects.select_for_update().get(id=run_id)
        if run.orchestrator_ref or run.status != Run.Status.QUEUED:
            return run.orchestrator_ref or None  # already submitted, or cancelled meanwhile
        provider = run_spec_resolved(run=run).orchestration.provider
        # The flow's own token: only its hash stays here.
        token = run_token_issue(run=run, purpose="orchestrator")
    try:
        ref = submit_training_run(run_id=run.id, tracker_url=settings.OOLONG_PUBLIC_URL,
                                  ingest_token=token, provider=provider, attempt=run.attempt)
    except Exception as exc:
        Run.objects.filter(id=run.id).update(
            submit_error=f"the orchestrator refused: {type(exc).__name__}: {exc}"[:1000])
        raise
    with transaction.atomic():
        run = Run.objects.select_for_update().get(id=run_id)
        if run.orchestrator_ref:  # a concurrent retry got the same flow first
            return run.orchestrator_ref
        run_orchestrator_ref_set(run=run, ref=ref)
        Run.objects.filter(id=run.id).update(submit_error="")
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


# The outbox: a run still queued without an orchestrator reference this long after its last
# send is sent again; after MAX_SUBMIT_ATTEMPTS sends it fails, with the reason.
SUBMIT_RETRY_S = 120.0
MAX_SUBMIT_ATTEMPTS = 5


def runs_reconcile() -> int:
    """Fail runs whose flow is gone without reporting an end (crash, lost machine), and send
    again the submissions nobody took (the broker was down, a worker died): see
    :func:`runs_resubmit`. Returns how many runs it failed or sent again."""
    from orchestration.trigger import flow_alive

    fixed = runs_resubmit()
    for run in Run.objects.exclude(status__in=Run.TERMINAL).exclude(orchestrator_ref=""):
        if flow_alive(run.orchestrator_ref) is False:
            run.refresh_from_db()
            if run.status not in Run.TERMINAL:
                run_status_set(run=run, status=Run.Status.FAILED,
                               reason=f"orchestrator lost the run ({run.orchestrator_ref} is gone)")
                fixed += 1
    return fixed


def runs_resubmit(*, retry_after_s: float = SUBMIT_RETRY_S,
                  max_attempts: int = MAX_SUBMIT_ATTEMPTS) -> int:
    """Runs stuck in ``queued`` without an orchestrator reference (their submission was never
    sent, lost with a worker, or refused) are sent again once ``retry_after_s`` passed since the
    last send; after ``max_attempts`` sends they fail, naming the last error."""
    from datetime import timedelta

    from django.db.models import Q
    from django.utils import timezone

    from webapp.runs.services import run_submit_send

    due = timezone.now() - timedelta(seconds=retry_after_s)
    stuck = (Run.objects.filter(status=Run.Status.QUEUED, orchestrator_ref="",
                                cancel_requested=False)
             .filter(Q(submit_sent_at__lt=due) | Q(submit_sent_at__isnull=True, created_at__lt=due)))
    count = 0
    for run in stuck:
        if run.submit_attempts >= max_attempts:
            reason = (f"not submitted after {run.submit_attempts} attempts: "
                      f"{run.submit_error or 'no worker started it'}")
            if run_status_set(run=run, status=Run.Status.FAILED, reason=reason).status == "failed":
                count += 1
            continue
        log.warning("run %s is still queued without a flow: sending its submission again "
                    "(attempt %d)", run.id, run.submit_attempts + 1)
        run_submit_send(run=run)
        count += 1
    return count
