"""Registering exported model versions, and the aliases users move over them.

The export itself is the engine's (``training_core.export.export_version``); it runs in a worker
(the ``oolong.model_export`` task), never in a web process: a request records what was asked and
queues the task once its row is committed.
"""

from __future__ import annotations

import json
import re
import shutil
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from webapp.config.celery import enqueue
from webapp.core.errors import ApplicationError
from webapp.registry.archive import folder_size
from webapp.registry.models import ModelAlias, ModelVersion
from webapp.registry.selectors import run_evaluations, run_step_versions
from webapp.runs.models import Run
from webapp.runs.services import run_event_add

EXPORT_TASK = "oolong.model_export"
# A pending export older than this no longer holds the run's turn (its task was lost with a
# broker, say); a new request goes ahead.
EXPORT_STALE_S = 3600
ALIAS = re.compile(r"^[a-z][a-z0-9_.-]{0,49}$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def model_store() -> Path:
    """Where exported folders live: ``$OOLONG_MEDIA_ROOT/models/`` (the web app's store)."""
    return Path(settings.MEDIA_ROOT) / "models"


def _check_selector(version: str | int) -> str:
    text = str(version).strip()
    if text in ("latest", "best") or (text.isdigit() and len(text) <= 18):
        return text
    raise ApplicationError(f"version {str(version)[:40]!r}: a version number, 'latest' or 'best'",
                           field="version")


@transaction.atomic
def model_version_request(*, run: Run, user, version: str | int = "latest",
                          name: str = "") -> ModelVersion:
    """Ask for ``version`` of ``run`` to be exported and registered. The worker resolves
    ``latest``/``best`` and writes the folder; the row says how it went (``status``)."""
    requested = _check_selector(version)
    name = name or run.name
    if not NAME.match(name):
        raise ApplicationError(f"name {name[:100]!r}: letters, digits, '.', '_' and '-', up to "
                               "100, starting with a letter or digit", field="name")
    if run.status in (Run.Status.QUEUED, Run.Status.PROVISIONING):
        raise ApplicationError(f"run {run.id} has not started: it holds no weights yet",
                               field="run", status_code=409)
    # One export of a run at a time, and a version once: each holds a model's worth of disk.
    Run.objects.select_for_update().filter(id=run.id).first()  # requests for one run queue here
    busy = ModelVersion.objects.filter(
        run=run, status=ModelVersion.Status.PENDING,
        created_at__gt=timezone.now() - timedelta(seconds=EXPORT_STALE_S)).first()
    if busy is not None:
        raise ApplicationError(f"model version {busy.id} of run {run.id} is still being exported; "
                               "ask again when it is ready or failed", field="run", status_code=409)
    if requested.isdigit():
        done = ModelVersion.objects.filter(run=run, version=int(requested),
                                           status=ModelVersion.Status.READY).first()
        if done is not None:
            raise ApplicationError(f"v{requested} of run {run.id} is already registered as model "
                                   f"version {done.id}", field="version", status_code=409)
    mv = ModelVersion.objects.create(
        project=run.project, run=run, name=name, requested=requested,
        dataset_version=run.dataset_version, reward_version=run.reward_version, created_by=user)
    transaction.on_commit(lambda: _send(mv))
    return mv


def _send(mv: ModelVersion) -> None:
    """Queue the export once its row is committed; a broker that refuses it fails the row with
    the reason (asking again makes a new one), rather than leaving it pending for ever."""
    try:
        enqueue(EXPORT_TASK, mv.id)
    except Exception as exc:  # noqa: BLE001 - whatever the broker raised, the row says so
        _failed(mv, f"the task queue is unreachable ({type(exc).__name__}: {exc})")


def model_version_export(*, model_version_id: int) -> dict:
    """The worker's part: export the run's version into the store and record it. Safe to run
    twice: a finished row is left alone, and a folder a killed worker finished is reused."""
    from orchestration.trigger import flow_run_dir

    from training_core.export import LINEAGE_FILE, ExportError, export_version

    mv = ModelVersion.objects.select_related("run", "dataset_version__dataset",
                                             "reward_version__reward_function").get(id=model_version_id)
    if mv.status != ModelVersion.Status.PENDING:
        return {"id": mv.id, "status": mv.status}
    run = mv.run
    out = model_store() / f"project-{mv.project_id}" / f"model-{mv.id}"
    if not (out / LINEAGE_FILE).exists():
        shutil.rmtree(out, ignore_errors=True)  # never a partial folder: export renames into place
        dv, rv = mv.dataset_version, mv.reward_version
        lineage = {"run": {"id": run.id, "project_id": run.project_id},
                   "dataset": {"version_id": dv.id, "name": dv.dataset.name, "version": dv.version},
                   "reward": {"version_id": rv.id, "name": rv.reward_function.name,
                              "version": rv.version},
                   "model_version_id": mv.id}
        run_dir = flow_run_dir(run.id)
        evaluations = run_evaluations(run=run)
        try:
            if (run_dir / "spec.yaml").exists():
                export_version(run_dir, mv.requested, out, lineage=lineage,
                               evaluations=evaluations)
            else:  # the trainer ran on another node: its durable checkpoints, if it has them
                _export_from_store(run, run_dir, mv.requested, out, lineage, evaluations)
        except ExportError as exc:
            return _failed(mv, f"{exc.field}: {exc}")
        except FileNotFoundError as exc:
            return _failed(mv, f"run: the run's files are not on this worker ({exc})")
        except Exception as exc:  # a full disk, a broken file: the row says so, the task fails
            _failed(mv, f"export: {type(exc).__name__}: {exc}")
            raise
    record = json.loads((out / LINEAGE_FILE).read_text())
    mv.version, mv.step, mv.source = record["version"], record["step"], record["source"]["kind"]
    mv.evaluation, mv.lineage, mv.path = record["evaluation"], record, str(out)
    mv.size_bytes, mv.status, mv.finished_at = folder_size(out), ModelVersion.Status.READY, timezone.now()
    try:
        with transaction.atomic():
            mv.save()
    except IntegrityError:  # this run's version is registered already: point there
        first = ModelVersion.objects.get(run=run, version=mv.version, status=ModelVersion.Status.READY)
        shutil.rmtree(out, ignore_errors=True)
        return _failed(mv, f"version: v{mv.version} of run {run.id} is already registered as "
                           f"model version {first.id}", version=mv.version)
    run_event_add(run=run, kind="model_exported",
                  message=f"v{mv.version} exported as model version {mv.id} ({mv.name})",
                  data={"model_version_id": mv.id, "version": mv.version},
                  dedup_key=f"model-export-{mv.id}")
    return {"id": mv.id, "status": mv.status, "version": mv.version}


def _export_from_store(run: Run, run_dir: Path, requested: str, out: Path, lineage: dict,
                       evaluations: dict[int, dict[str, float]]) -> None:
    """A run whose directory is on another node (a placed run): exported from the checkpoint
    the durable store holds (``$OOLONG_CHECKPOINT_STORE``, keyed by the run directory's name as
    the trainer keyed it), staged in a folder of the model store and removed after. The spec
    and the steps' versions are the web app's own record (the run row, the tracker)."""
    from training_core.checkpoint_store import STORE_ENV, CheckpointStore
    from training_core.config import RunSpec
    from training_core.export import ExportError, export_version, stage_from_store

    store = CheckpointStore.from_env(run_dir)
    if store is None:
        raise ExportError(f"the run's files ({run_dir}) are not on this worker and no durable "
                          f"checkpoint store is set ({STORE_ENV}): export on the node that ran "
                          f"it (oolong export), or set {STORE_ENV} where the trainer and this "
                          "worker both reach it", field="run")
    staging = model_store() / ".staging" / f"{run_dir.name}-{out.name}"
    try:
        staged = stage_from_store(store, RunSpec.model_validate(run.spec), requested, staging,
                                  step_versions=run_step_versions(run=run),
                                  evaluations=evaluations)
        where = {"dir": f"{store.url}/{run_dir.name}", **lineage.get("run", {})}
        export_version(staged, requested, out, lineage={**lineage, "run": where},
                       evaluations=evaluations)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _failed(mv: ModelVersion, error: str, **fields) -> dict:
    ModelVersion.objects.filter(id=mv.id).update(status=ModelVersion.Status.FAILED, error=error[:4000],
                                                 finished_at=timezone.now(), **fields)
    return {"id": mv.id, "status": ModelVersion.Status.FAILED, "error": error}


@transaction.atomic
def model_alias_set(*, model_version: ModelVersion, alias: str, user) -> ModelAlias:
    """Point the project's ``alias`` at ``model_version`` (created, or moved from another)."""
    if not ALIAS.match(alias):
        raise ApplicationError(f"alias {alias[:60]!r}: lower-case letters, digits, '.', '_' and "
                               "'-', up to 50, starting with a letter", field="alias")
    if model_version.status != ModelVersion.Status.READY:
        raise ApplicationError(f"model version {model_version.id} is {model_version.status}: only "
                               "a ready one can carry an alias", field="model_version",
                               status_code=409)
    found, _ = ModelAlias.objects.select_for_update().update_or_create(
        project_id=model_version.project_id, name=alias,
        defaults={"model_version": model_version, "updated_by": user})
    return found


def model_alias_delete(*, model_version: ModelVersion, alias: str) -> None:
    deleted, _ = ModelAlias.objects.filter(model_version=model_version, name=alias).delete()
    if not deleted:
        raise ApplicationError(f"model version {model_version.id} has no alias {alias[:60]!r}",
                               field="alias", status_code=404)
