from __future__ import annotations

import os
import tempfile
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction

from webapp.accounts.models import Project
from webapp.core.errors import ApplicationError
from webapp.datasets.builtins import BUILTINS
from webapp.datasets.models import Dataset, DatasetVersion
from webapp.datasets.validation import (
    ParseLimits,
    detect_format,
    validate_upload_bounded,
    write_rows,
)


def _rows_dir() -> Path:
    root = Path(settings.MEDIA_ROOT) / "datasets"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _store_rows_file(tmp_path: str, checksum: str) -> str:
    """Move a rows file written by write_rows to its content-addressed place (identical uploads
    share one file). Same directory, so the rename is atomic."""
    path = _rows_dir() / f"{checksum}.jsonl"
    if path.exists():
        os.unlink(tmp_path)
    else:
        os.replace(tmp_path, path)
    return str(path)


def _builtin_rows(name: str, size: int, seed: int) -> list[dict]:
    if name == "arithmetic":
        from training_core.data.synthetic import arithmetic_items

        return [{"question": r["question"], "answer": r["answer"], "solution": r["solution"]}
                for r in arithmetic_items(size, seed, max_value=30)]
    if name == "gsm_symbolic":
        from training_core.data.datasets import reasoning_gym_rows

        return [{"question": r["question"], "answer": r["answer"]}
                for r in reasoning_gym_rows("gsm_symbolic", size, seed, {})]
    raise ApplicationError(f"unknown built-in {name!r}; use one of {', '.join(BUILTINS)}",
                           field="builtin")


@transaction.atomic
def _version_create(*, dataset: Dataset, summary: dict, rows_file: str, source: str,
                    file_format: str, user) -> DatasetVersion:
    """A new version from ``rows_file`` (written by write_rows) and its ``summary``."""
    latest = dataset.versions.select_for_update().order_by("-version").first()
    if latest is not None and latest.checksum == summary["checksum"]:
        os.unlink(rows_file)
        return latest  # re-uploading the same content is a no-op, not a new version
    path = _store_rows_file(rows_file, summary["checksum"])
    return DatasetVersion.objects.create(
        dataset=dataset, version=(latest.version + 1) if latest else 1, source=source,
        file_format=file_format, checksum=summary["checksum"], rows_path=path,
        row_count=summary["row_count"], stats=summary["stats"], preview=summary["preview"],
        created_by=user)


def _incoming_path() -> str:
    """Where a rows file is written before it has a checksum: next to its final place."""
    fd, path = tempfile.mkstemp(prefix="incoming-", suffix=".jsonl.tmp", dir=_rows_dir())
    os.close(fd)
    return path


def _dataset_get_or_create(*, project: Project, name: str, task: str, user, description: str = "") -> Dataset:
    if not name.strip():
        raise ApplicationError("name is required", field="name")
    if task not in Dataset.Task.values:
        raise ApplicationError(f"unknown task {task!r}; use one of {', '.join(Dataset.Task.values)}",
                               field="task")
    dataset = Dataset.objects.filter(project=project, name=name).first()
    if dataset is not None:
        if dataset.task != task:
            raise ApplicationError(f"dataset {name!r} exists with task {dataset.task!r}", field="task")
        return dataset
    try:
        with transaction.atomic():
            return Dataset.objects.create(project=project, name=name, task=task,
                                          description=description, created_by=user)
    except IntegrityError:
        return Dataset.objects.get(project=project, name=name)


def dataset_upload(*, project: Project, user, name: str, task: str, filename: str, data: bytes,
                   file_format: str | None = None, description: str = "",
                   is_eval_set: bool = False) -> DatasetVersion:
    """Validate a file; on success store a new immutable version (marked as an eval set when
    ``is_eval_set``). On any error nothing is stored and the error lists every bad row (up to
    50) with its line number."""
    if len(data) > settings.DATASET_MAX_UPLOAD_BYTES:
        raise ApplicationError(
            f"file is {len(data) / 1e6:.1f} MB; the limit is "
            f"{settings.DATASET_MAX_UPLOAD_BYTES / 1e6:.0f} MB (OOLONG_DATASET_MAX_UPLOAD_MB)",
            field="file", status_code=413)
    fmt = file_format or detect_format(filename)
    if fmt is None:
        raise ApplicationError("cannot tell the format from the file name; name it .jsonl, "
                               ".parquet or .csv, or set file_format", field="file_format")
    rows_file = _incoming_path()
    try:
        # The child parses, checks and writes the rows; only a bounded summary comes back.
        result = validate_upload_bounded(data, fmt, task, rows_file, ParseLimits(
            max_rows=settings.DATASET_MAX_ROWS,
            max_decompressed_bytes=settings.DATASET_MAX_DECOMPRESSED_BYTES,
            memory_bytes=settings.DATASET_PARSE_MEMORY_BYTES,
            max_cell_chars=settings.DATASET_MAX_CELL_CHARS))
        if result.errors or result.summary is None:
            more = " (first 50 shown)" if result.truncated else ""
            raise ApplicationError(
                f"{len(result.errors)} problem(s) in {filename}{more}; nothing was stored",
                errors=[{**e, "field": e["field"] or "file"} for e in result.errors])
        with transaction.atomic():
            dataset = _dataset_get_or_create(project=project, name=name, task=task, user=user,
                                             description=description)
            version = _version_create(dataset=dataset, summary=result.summary,
                                      rows_file=rows_file, source=filename, file_format=fmt,
                                      user=user)
            if is_eval_set and not version.is_eval_set:
                version = dataset_version_eval_set_mark(version=version, is_eval_set=True)
            return version
    finally:
        if os.path.exists(rows_file):  # refused, or the transaction failed
            os.unlink(rows_file)


def dataset_create_builtin(*, project: Project, user, name: str, builtin: str, size: int = 2000,
                           seed: int = 0) -> DatasetVersion:
    rows = _builtin_rows(builtin, size, seed)
    task = "arithmetic" if builtin == "arithmetic" else "qa"
    rows_file = _incoming_path()
    try:
        summary = write_rows(rows, rows_file)
        with transaction.atomic():
            dataset = _dataset_get_or_create(project=project, name=name, task=task, user=user,
                                             description=BUILTINS[builtin])
            return _version_create(dataset=dataset, summary=summary, rows_file=rows_file,
                                   source=f"builtin:{builtin}", file_format="jsonl", user=user)
    finally:
        if os.path.exists(rows_file):
            os.unlink(rows_file)


def dataset_version_revalidate(*, version_id: int) -> dict:
    """Check a stored version against its task schema again; returns {ok, errors}."""
    from webapp.datasets.selectors import dataset_version_rows
    from webapp.datasets.validation import ValidationResult, validate_rows

    version = DatasetVersion.objects.select_related("dataset").get(id=version_id)
    result = ValidationResult()
    parsed = list(enumerate(dataset_version_rows(version=version), 1))
    validate_rows(parsed, version.dataset.task, result)
    return {"ok": not result.errors, "errors": result.errors, "rows": len(parsed)}


def dataset_version_eval_set_mark(*, version: DatasetVersion, is_eval_set: bool) -> DatasetVersion:
    """Mark (or unmark) a version as an eval set: runs of its project may then attach it
    (``run_create(eval_set_versions=...)``). The caller has checked that the user is a member
    of the version's project (``dataset_version_get``). Runs that attached it keep it."""
    DatasetVersion.objects.filter(id=version.id).update(is_eval_set=is_eval_set)
    version.is_eval_set = is_eval_set
    return version
