"""Parse an uploaded dataset file and check every row against the task's schema.

Returns rows or a list of row-level errors ({line, field, message}); never stores anything.
Line numbers are 1-based lines of the file (JSONL, CSV: the header is line 1) or row numbers
(Parquet).

An upload is parsed in a child process (:func:`validate_upload_bounded`) under an address-space
limit and a deadline: a file that expands beyond what its size suggests (a Parquet decompression
or dictionary bomb, JSON that inflates into millions of objects) costs that child, never the web
process. Row count and decompressed size have limits of their own with clear messages.

The child also writes the checked rows to their file (:func:`write_rows`) and hands the web
process only a summary: the row count, the checksum, the stats and a preview whose rows and cells
are capped (``PREVIEW_ROWS``, ``PREVIEW_CELL_CHARS``). The rows never pass through the web
process's memory, and no cell is longer than ``ParseLimits.max_cell_chars`` (a 2.5 kB Parquet of
40 rows x 1 MiB once made a 21 MB response and a 20 MB database row).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

from webapp.core.json_input import json_problem

MAX_ERRORS = 50
PREVIEW_ROWS = 20
PREVIEW_CELL_CHARS = 500  # a preview cell is cut here, with an ellipsis
STATS_MAX_COLUMNS = 100  # column names listed in the stats, each cut at PREVIEW_CELL_CHARS
GSM8K_FINAL = re.compile(r"####\s*-?[\d,]+(\.\d+)?\s*$")
NUMBER = re.compile(r"^-?\d[\d,]*(\.\d+)?$")

TASK_FIELDS = {"qa": ("question", "answer"), "gsm8k": ("question", "answer"),
               "arithmetic": ("question", "answer")}
FORMATS = ("jsonl", "parquet", "csv")
CSV_EXTRA = "\0extra"  # where csv.DictReader puts fields beyond the header


@dataclass(frozen=True)
class ParseLimits:
    max_rows: int = 1_000_000
    max_decompressed_bytes: int = 512 * 1024 * 1024  # Parquet: data pages once decompressed
    memory_bytes: int = 1024 * 1024 * 1024  # the parsing child's address space
    timeout_s: float = 120.0
    max_cell_chars: int = 131_072  # one field of one row, as text or as JSON


@dataclass
class ValidationResult:
    rows: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    truncated: bool = False
    # From the bounded child: what write_rows returned (rows stay in the file it wrote).
    summary: dict[str, Any] | None = None

    def error(self, line: int | None, field_name: str | None, message: str) -> None:
        if len(self.errors) >= MAX_ERRORS:
            self.truncated = True
            return
        # Field names come from the file: bounded, like everything that reaches the response.
        self.errors.append({"line": line, "field": field_name[:200] if field_name else field_name,
                            "message": message[:1000]})


def detect_format(filename: str) -> str | None:
    lower = filename.lower()
    for ext, fmt in ((".jsonl", "jsonl"), (".json", "jsonl"), (".parquet", "parquet"), (".csv", "csv")):
        if lower.endswith(ext):
            return fmt
    return None


def _too_many_rows(count: int, limits: ParseLimits, result: ValidationResult) -> bool:
    if count > limits.max_rows:
        result.error(None, "file", f"the file has more than {limits.max_rows:,} rows "
                                   "(OOLONG_DATASET_MAX_ROWS); split it or raise the limit")
        return True
    return False


def _parquet_rows(data: bytes, limits: ParseLimits, result: ValidationResult) -> list[tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(io.BytesIO(data))
    except (pa.ArrowException, OSError) as exc:
        result.error(None, None, f"not a readable Parquet file: {exc}")
        return []
    meta = pf.metadata
    if _too_many_rows(meta.num_rows, limits, result):
        return []
    # The footer states every column chunk's decompressed size: refuse a bomb before inflating it.
    expanded = sum(meta.row_group(g).column(c).total_uncompressed_size
                   for g in range(meta.num_row_groups) for c in range(meta.num_columns))
    if expanded > limits.max_decompressed_bytes:
        result.error(None, "file", f"the Parquet data expands to {expanded / 1e6:,.0f} MB; the "
                                   f"limit is {limits.max_decompressed_bytes / 1e6:,.0f} MB")
        return []
    try:
        table = pf.read()
    except (pa.ArrowException, OSError) as exc:
        result.error(None, None, f"not a readable Parquet file: {exc}")
        return []
    rows = []
    for i, row in enumerate(table.to_pylist(), 1):
        # Rows are stored as JSON: a timestamp or bytes column is a field error, not a crash.
        if not _json_ok(row):
            bad = next(k for k, v in row.items() if not _json_ok(v))
            result.error(i, bad, f"has a value of type {type(row[bad]).__name__}, which is not "
                                 "text, a number or a list/object of those")
            continue
        rows.append((i, row))
    return rows


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _parse(data: bytes, fmt: str, result: ValidationResult,
           limits: ParseLimits = ParseLimits()) -> list[tuple[int, Any]]:
    if fmt == "jsonl":
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            result.error(None, None, f"file is not UTF-8 text ({exc.reason} at byte {exc.start})")
            return []
        out = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            if _too_many_rows(len(out) + 1, limits, result):
                return []
            try:
                out.append((lineno, json.loads(line)))
            except json.JSONDecodeError as exc:
                result.error(lineno, None, f"not valid JSON: {exc.msg} (column {exc.colno})")
            except RecursionError:
                result.error(lineno, None, "nested too deeply")
        return out
    if fmt == "csv":
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            result.error(None, None, f"file is not UTF-8 text ({exc.reason} at byte {exc.start})")
            return []
        # Fields beyond the header land under the key None: a row error, not a crash.
        reader = csv.DictReader(io.StringIO(text), restkey=CSV_EXTRA)
        out = []
        try:
            for i, row in enumerate(reader):
                if _too_many_rows(i + 1, limits, result):
                    return []
                if CSV_EXTRA in row:
                    extra = len(row[CSV_EXTRA])
                    result.error(i + 2, None, f"has {extra} more field(s) than the header")
                    continue
                out.append((i + 2, row))
        except csv.Error as exc:
            result.error(reader.line_num, None, f"not valid CSV: {exc}")
        return out
    if fmt == "parquet":
        return _parquet_rows(data, limits, result)
    result.error(None, "file_format", f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    return []


def _cell_chars(value: Any) -> int:
    return len(value) if isinstance(value, str) else len(json.dumps(value, ensure_ascii=False))


def validate_rows(parsed: list[tuple[int, Any]], task: str, result: ValidationResult,
                  max_cell_chars: int = ParseLimits.max_cell_chars) -> None:
    required = TASK_FIELDS[task]
    for line, row in parsed:
        if not isinstance(row, dict):
            result.error(line, None, "each row must be an object with named fields")
            continue
        if (bad := json_problem(row)) is not None:
            result.error(line, bad[0] or None, bad[1])
            continue
        big = next((k for k, v in row.items() if len(str(k)) > PREVIEW_CELL_CHARS
                    or _cell_chars(v) > max_cell_chars), None)
        if big is not None:
            name = str(big)[:60]
            result.error(line, name, f"is longer than {max_cell_chars:,} characters (or has a "
                                     "name that long); OOLONG_DATASET_MAX_CELL_CHARS sets the limit")
            continue
        missing = [f for f in required if f not in row]
        if missing:
            result.error(line, missing[0], f"missing field(s) {missing}; the {task} task needs "
                                           f"{list(required)} (found {sorted(row)[:8]})")
            continue
        ok = True
        for name in required:
            value = row[name]
            if value is None or (isinstance(value, str) and not value.strip()):
                result.error(line, name, "is empty")
                ok = False
            elif not isinstance(value, (str, int, float)):
                result.error(line, name, f"must be text or a number, got {type(value).__name__}")
                ok = False
        if not ok:
            continue
        answer = str(row["answer"]).strip()
        if task == "gsm8k" and not GSM8K_FINAL.search(answer):
            result.error(line, "answer", "GSM8K answers must end with '#### <number>'")
            continue
        if task == "arithmetic" and not NUMBER.match(answer):
            result.error(line, "answer", f"must be a number, got {answer[:30]!r}")
            continue
        result.rows.append({k: v for k, v in row.items()} | {"question": str(row["question"]),
                                                              "answer": answer})


def validate_upload(data: bytes, fmt: str, task: str,
                    limits: ParseLimits = ParseLimits()) -> ValidationResult:
    """Parse and check in this process: for trusted data. Uploads go through
    :func:`validate_upload_bounded`."""
    result = ValidationResult()
    if task not in TASK_FIELDS:
        result.error(None, "task", f"unknown task {task!r}; use one of {', '.join(TASK_FIELDS)}")
        return result
    parsed = _parse(data, fmt, result, limits)
    if not result.errors and not parsed:
        result.error(None, "file", "the file has no rows")
    validate_rows(parsed, task, result, limits.max_cell_chars)
    if result.errors:
        result.rows = []
    return result


def dataset_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    q = [len(r["question"]) for r in rows]
    a = [len(r["answer"]) for r in rows]
    columns = sorted({k for r in rows for k in r})
    return {
        "rows": len(rows),
        "question_chars": {"min": min(q), "mean": round(sum(q) / len(q), 1), "max": max(q)},
        "answer_chars": {"min": min(a), "mean": round(sum(a) / len(a), 1), "max": max(a)},
        "columns": [_cut(c) for c in columns[:STATS_MAX_COLUMNS]],
        "column_count": len(columns),
        "duplicate_questions": len(q) - len({r["question"] for r in rows}),
    }


def _cut(value: Any) -> Any:
    """A preview's copy of a cell: text cut at ``PREVIEW_CELL_CHARS``; a list or object longer
    than that as JSON becomes its cut JSON text."""
    if isinstance(value, str):
        return value if len(value) <= PREVIEW_CELL_CHARS else value[:PREVIEW_CELL_CHARS] + "…"
    if isinstance(value, (list, dict)):
        text = json.dumps(value, ensure_ascii=False)
        return value if len(text) <= PREVIEW_CELL_CHARS else text[:PREVIEW_CELL_CHARS] + "…"
    return value


def write_rows(rows: list[dict[str, Any]], path: str) -> dict[str, Any]:
    """Write checked rows as JSONL to ``path`` and return what the database keeps about them:
    ``{"checksum", "row_count", "stats", "preview"}``. The checksum is over the rows with sorted
    keys (the same content in another column order is the same version)."""
    digest = hashlib.sha256()
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            digest.update((json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n").encode())
    return {"checksum": digest.hexdigest(), "row_count": len(rows), "stats": dataset_stats(rows),
            "preview": [{_cut(k): _cut(v) for k, v in row.items()} for row in rows[:PREVIEW_ROWS]]}


def _child_limits(memory_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def validate_upload_bounded(data: bytes, fmt: str, task: str, rows_path: str,
                            limits: ParseLimits = ParseLimits()) -> ValidationResult:
    """:func:`validate_upload` in a child process with an address-space limit and a deadline.
    On success the child has written the rows to ``rows_path`` and ``summary`` says what
    :func:`write_rows` returned; the result holds no rows."""
    result = ValidationResult()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    with tempfile.TemporaryDirectory(prefix="oolong-parse-") as tmp:
        source, out = os.path.join(tmp, "upload"), os.path.join(tmp, "result.json")
        with open(source, "wb") as fh:
            fh.write(data)
        argv = [sys.executable, "-m", "webapp.datasets.validation", source, fmt, task, out,
                json.dumps(asdict(limits)), rows_path]
        try:
            proc = subprocess.run(argv, env=env, capture_output=True, timeout=limits.timeout_s,
                                  preexec_fn=lambda: _child_limits(limits.memory_bytes))
        except subprocess.TimeoutExpired:
            result.error(None, "file", f"parsing took longer than {limits.timeout_s:.0f} s")
            return result
        if proc.returncode != 0 or not os.path.exists(out):
            tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
            if "MemoryError" in tail[0] or "bad_alloc" in tail[0] or "allocat" in tail[0].lower() \
                    or proc.returncode < 0:
                result.error(None, "file", "the file expands beyond "
                                           f"{limits.memory_bytes / 2**20:,.0f} MiB when parsed "
                                           "(a compressed or deeply repeated payload?); nothing "
                                           "was stored")
            else:
                result.error(None, "file", f"the file could not be parsed: {tail[0][:200]}")
            return result
        with open(out) as fh:
            return ValidationResult(**json.load(fh))


def _child_main(argv: list[str]) -> None:
    """The bounded child: ``python -m webapp.datasets.validation SRC FMT TASK OUT LIMITS ROWS``."""
    src, fmt, task, out, limits, rows_path = argv
    with open(src, "rb") as fh:
        result = validate_upload(fh.read(), fmt, task, ParseLimits(**json.loads(limits)))
    if not result.errors:
        result.summary = write_rows(result.rows, rows_path)
    result.rows = []  # in the file now: the web process reads only the summary
    with open(out, "w") as fh:
        json.dump(asdict(result), fh)


if __name__ == "__main__":
    _child_main(sys.argv[1:7])
