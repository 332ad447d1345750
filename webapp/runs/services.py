from __future__ import annotations

import re
import secrets
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from webapp.accounts.models import Project
from webapp.config.celery import enqueue
from webapp.core.errors import ApplicationError
from webapp.core.json_input import json_check
from webapp.datasets.models import DatasetVersion
from webapp.datasets.selectors import dataset_version_prompt_template
from webapp.rewards.models import RewardFunctionVersion
from webapp.runs.models import MAX_EVAL_SETS, Run, RunEvalSet, RunEvent, RunToken, token_hash
from webapp.runs.policy import check_quota, check_spec_allowed


def run_spec_validate(*, spec: dict[str, Any]) -> dict[str, Any]:
    """Validate with training_core's schema; errors come back per field (spec.<dotted key>)."""
    from training_core.config import SpecError, spec_from_dict

    if not isinstance(spec, dict):
        raise ApplicationError("spec must be a mapping of sections", field="spec")
    try:
        return spec_from_dict(spec).model_dump(mode="json")
    except SpecError as exc:
        raise ApplicationError(
            "invalid run spec: " + "; ".join(f"{k}: {v}" for k, v in exc.errors.items()),
            errors=[{"field": f"spec.{k}", "message": v} for k, v in exc.errors.items()]) from None


def run_spec_check(*, user, spec: dict[str, Any] | None = None,
                   text: str | None = None) -> dict[str, Any]:
    """What the run form asks as the user types: the spec (a mapping, or its YAML ``text``)
    checked field by field with the same messages as ``run_create`` (SpecError's, and the
    administrator-only fields), without creating anything. Returns ``{"valid", "errors",
    "spec" (the mapping), "yaml" (its text), "resolved" (the full spec, or None)}``."""
    from webapp.core.spec_yaml import spec_from_yaml, spec_to_yaml

    if text is not None:
        try:
            spec = spec_from_yaml(text, field="yaml")  # the input field that holds the text
        except ApplicationError as exc:
            return {"valid": False, "errors": exc.errors, "spec": None, "yaml": text,
                    "resolved": None}
    spec = dict(json_check(spec or {}, "spec"))
    answer = {"valid": True, "errors": [], "spec": spec,
              "yaml": text if text is not None else spec_to_yaml(spec), "resolved": None}
    try:
        _refuse_user_eval_sets(spec)
        answer["resolved"] = run_spec_validate(spec=spec)
        check_spec_allowed(user=user, spec=answer["resolved"])
    except ApplicationError as exc:
        answer.update(valid=False, errors=exc.errors, resolved=None)
    return answer


def _refuse_user_eval_sets(spec: dict[str, Any]) -> None:
    """``eval.sets`` names files on the trainer's node: the web app sets it from the eval-set
    dataset versions attached to the run, never from the spec a user sends."""
    section = spec.get("eval")
    if isinstance(section, dict) and "sets" in section:
        raise ApplicationError(
            "eval.sets is set by the platform: attach eval-set dataset versions to the run "
            "instead (eval_set_versions; mark a dataset version as an eval set first)",
            field="spec.eval.sets")


def eval_set_name(dataset_name: str, taken: set[str]) -> str:
    """An eval set's name in a run (``eval/<name>/...``): the dataset's name as a slug (a-z, 0-9,
    _ and -, at most 40 characters), never ``heldout`` (the run's own set) and not one of
    ``taken`` (a number is added)."""
    from training_core.metric_names import DEFAULT_EVAL_SET

    base = re.sub(r"[^a-z0-9_-]+", "-", dataset_name.lower()).strip("-_")[:40] or "set"
    name, n = base, 1
    while name in taken or name == DEFAULT_EVAL_SET:
        n += 1
        name = f"{base[:40 - len(str(n)) - 1]}-{n}"
    return name


def _eval_sets_check(project: Project, versions: list[DatasetVersion]) -> list[DatasetVersion]:
    if len(versions) > MAX_EVAL_SETS:
        raise ApplicationError(f"{len(versions)} eval sets; a run takes at most {MAX_EVAL_SETS}",
                               field="eval_set_versions")
    seen = set()
    for v in versions:
        if v.id in seen:
            raise ApplicationError(f"dataset version {v.id} is listed twice",
                                   field="eval_set_versions")
        seen.add(v.id)
        if v.dataset.project_id != project.id:
            raise ApplicationError(f"dataset version {v.id} belongs to another project",
                                   field="eval_set_versions")
        if not v.is_eval_set:
            raise ApplicationError(f"dataset version {v.id} ({v}) is not marked as an eval set; "
                                   "mark it on its dataset's page (or PATCH "
                                   f"/api/dataset-versions/{v.id}/ with is_eval_set: true)",
                                   field="eval_set_versions")
    return versions


@transaction.atomic
def run_create(*, project: Project, user, name: str, dataset_version: DatasetVersion,
               reward_version: RewardFunctionVersion, spec: dict[str, Any] | None = None,
               sweep=None, sweep_values: dict[str, Any] | None = None,
               eval_set_versions: list[DatasetVersion] | None = None) -> Run:
    """Validate, check the administrator policy, store, and submit on commit. ``sweep``: the
    sweep (webapp.sweeps) this run belongs to, with its values of the sweep's axes.
    ``eval_set_versions``: dataset versions of the project marked as eval sets (at most
    MAX_EVAL_SETS), each evaluated as ``eval/<name>/...``; the spec's ``eval.sets`` is set
    from them (a user-given one is refused)."""
    if dataset_version.dataset.project_id != project.id:
        raise ApplicationError("dataset version belongs to another project", field="dataset_version")
    if reward_version.reward_function.project_id != project.id:
        raise ApplicationError("reward version belongs to another project", field="reward_version")
    if reward_version.status != RewardFunctionVersion.Status.VALID:
        raise ApplicationError(f"reward version is {reward_version.status}; only validated "
                               "reward functions can be used", field="reward_version")
    eval_sets = _eval_sets_check(project, list(eval_set_versions or []))
    spec = dict(json_check(spec or {}, "spec"))
    _refuse_user_eval_sets(spec)
    spec["name"] = name
    names: list[str] = []
    for v in eval_sets:
        names.append(eval_set_name(v.dataset.name, set(names)))
    if names:  # where the node puts each set's rows (training_core.remote_run rewrites them)
        from training_core.remote_run import EVAL_SETS_DIR

        spec["eval"] = {**(spec.get("eval") or {}), "sets": [
            {"name": n, "source": f"jsonl:{EVAL_SETS_DIR}/{n}.jsonl"} for n in names]}
    # The dataset and reward are fixed by the run, not by free-form spec fields.
    spec["data"] = dict(spec.get("data") or {})
    spec.setdefault("reward", {})
    template = dataset_version_prompt_template(version=dataset_version)
    if template is not None:
        spec["data"].setdefault("prompt_template", template)
    resolved = run_spec_validate(spec=spec)
    check_spec_allowed(user=user, spec=resolved)
    check_quota(project=project, user=user, spec=resolved)
    resolved["reward"]["fn"] = reward_version.fn_path
    online = (resolved.get("rollout") or {}).get("mode") == "online"
    run = Run.objects.create(project=project, name=name, dataset_version=dataset_version,
                             reward_version=reward_version, spec=resolved, created_by=user,
                             sweep=sweep, sweep_values=sweep_values or {},
                             gateway_key=secrets.token_urlsafe(32) if online else "")
    RunEvalSet.objects.bulk_create([RunEvalSet(run=run, dataset_version=v, name=n, position=i)
                                    for i, (v, n) in enumerate(zip(eval_sets, names, strict=True))])
    run_event_add(run=run, kind="created", message=f"run created by {user}")
    transaction.on_commit(lambda: run_submit_send(run=run))
    return run


SUBMIT_TASK = "oolong.run_submit"


def run_submit_send(*, run: Run) -> bool:
    """The submission outbox's send: put the run's submission on the task queue, after its row
    is committed. False if the broker refused it (down, unreachable): the run stays in the
    outbox (queued, without an orchestrator reference), ``run.submit_error`` says why, and
    ``runs_reconcile`` sends it again (a run created while the broker was down used to answer
    500 and stay queued forever)."""
    error = ""
    try:
        enqueue(SUBMIT_TASK, run.id)
    except Exception as exc:  # noqa: BLE001 - whatever the broker raised, the outbox keeps the run
        error = f"the task queue is unreachable ({type(exc).__name__}: {exc})"[:1000]
    Run.objects.filter(id=run.id).update(submit_attempts=F("submit_attempts") + 1,
                                         submit_sent_at=timezone.now(), submit_error=error)
    run.submit_error = error
    return not error


def run_token_issue(*, run: Run, purpose: str) -> str:
    """A new ingest token for the run. Only its hash is stored: show the plaintext once."""
    token = secrets.token_urlsafe(32)
    RunToken.objects.create(run=run, token_hash=token_hash(token), purpose=purpose)
    return token


def run_event_add(*, run: Run, kind: str, message: str, data: dict | None = None,
                  dedup_key: str | None = None) -> RunEvent | None:
    try:
        with transaction.atomic():
            return RunEvent.objects.create(run=run, kind=kind, message=message, data=data or {},
                                           dedup_key=dedup_key)
    except IntegrityError:
        return None  # already recorded (a retried report)


@transaction.atomic
def run_status_set(*, run: Run, status: str, reason: str = "") -> Run:
    run = Run.objects.select_for_update().get(id=run.id)
    if status == run.status:
        return run
    if run.status in Run.TERMINAL:
        return run  # terminal states are final; late reports are ignored
    if status not in Run.TRANSITIONS.get(run.status, set()):
        raise ApplicationError(f"cannot move a {run.status} run to {status}", field="status",
                               status_code=409)
    run.status = status
    run.status_reason = reason
    now = timezone.now()
    if status == Run.Status.RUNNING and not run.started_at:
        run.started_at = now
    if status in Run.TERMINAL:
        run.finished_at = now
        run.started_at = run.started_at or now
        # A finished run's tokens are refused from now on (the status report was the last call).
        RunToken.objects.filter(run=run, revoked_at__isnull=True).update(revoked_at=now)
    run.save(update_fields=["status", "status_reason", "started_at", "finished_at"])
    run_event_add(run=run, kind="status", message=f"{status}" + (f": {reason}" if reason else ""))
    return run


@transaction.atomic
def run_cancel(*, run: Run, user) -> Run:
    run = Run.objects.select_for_update().get(id=run.id)
    if run.status in Run.TERMINAL:
        raise ApplicationError(f"run is already {run.status}", field="status", status_code=409)
    run.cancel_requested = True
    run.save(update_fields=["cancel_requested"])
    run_event_add(run=run, kind="cancel_requested", message=f"cancel requested by {user}")
    if run.status == Run.Status.QUEUED and not run.orchestrator_ref:
        return run_status_set(run=run, status=Run.Status.CANCELLED, reason="cancelled before start")
    transaction.on_commit(lambda: enqueue("oolong.run_cancel", run.id))
    return run


@transaction.atomic
def run_resume(*, run: Run, user) -> Run:
    """Start a failed or cancelled run again from its latest checkpoint (the run directory's, or
    the durable store's on fresh nodes). A new attempt: new tokens at submission, a new flow."""
    run = Run.objects.select_for_update().get(id=run.id)
    if run.status not in (Run.Status.FAILED, Run.Status.CANCELLED):
        raise ApplicationError(f"only a failed or cancelled run can be resumed; this one is "
                               f"{run.status}", field="status", status_code=409)
    check_spec_allowed(user=user, spec=run.spec)
    run.status = Run.Status.QUEUED
    run.status_reason = ""
    run.finished_at = None
    run.cancel_requested = False
    run.orchestrator_ref = ""
    run.attempt += 1
    run.submit_attempts, run.submit_error = 0, ""  # a fresh submission, with its own sends
    run.save(update_fields=["status", "status_reason", "finished_at", "cancel_requested",
                            "orchestrator_ref", "attempt", "submit_attempts", "submit_error"])
    run_event_add(run=run, kind="resume_requested",
                  message=f"resume requested by {user} (attempt {run.attempt})")
    transaction.on_commit(lambda: run_submit_send(run=run))
    return run


def run_orchestrator_ref_set(*, run: Run, ref: str) -> Run:
    Run.objects.filter(id=run.id).update(orchestrator_ref=ref)
    run.orchestrator_ref = ref
    return run
