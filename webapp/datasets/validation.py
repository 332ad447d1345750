"""Parse an uploaded dataset file and check every row against the task's schema.

Returns rows or a list of row-level errors ({line, field, message}); never stores anything.
Line numbers are 1-based lines of the file (JSONL, CSV: the header is line 1) or row numbers
(Parquet).
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass, field
from typing import Any

MAX_ERRORS = 50
GSM8K_FINAL = re.compile(r"####\s*-?[\d,]+(\.\d+)?\s*$")
NUMBER = re.compile(r"^-?\d[\d,]*(\.\d+)?$")

TASK_FIELDS = {"qa": ("question", "answer"), "gsm8k": ("question", "answer"),
               "arithmetic": ("question", "answer")}
FORMATS = ("jsonl", "parquet", "csv")


@dataclass
class ValidationResult:
    rows: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    truncated: bool = False

    def error(self, line: int | None, field_name: str | None, message: str) -> None:
        if len(self.errors) >= MAX_ERRORS:
            self.truncated = True
            return
        self.errors.append({"line": line, "field": field_name, "message": message})


def detect_format(filename: str) -> str | None:
    lower = filename.lower()
    for ext, fmt in ((".jsonl", "jsonl"), (".json", "jsonl"), (".parquet", "parquet"), (".csv", "csv")):
        if lower.endswith(ext):
            return fmt
    return None


def _parse(data: bytes, fmt: str, result: ValidationResult) -> list[tuple[int, Any]]:
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
            try:
                out.append((lineno, json.loads(line)))
            except json.JSONDecodeError as exc:
                result.error(lineno, None, f"not valid JSON: {exc.msg} (column {exc.colno})")
        return out
    if fmt == "csv":
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            result.error(None, None, f"file is not UTF-8 text ({exc.reason} at byte {exc.start})")
            return []
        reader = csv.DictReader(io.StringIO(text))
        return [(i + 2, row) for i, row in enumerate(reader)]
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(io.BytesIO(data))
        except (pa.ArrowException, OSError) as exc:
            result.error(None, None, f"not a readable Parquet file: {exc}")
            return []
        return list(enumerate(table.to_pylist(), 1))
    result.error(None, "file_format", f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    return []


def validate_rows(parsed: list[tuple[int, Any]], task: str, result: ValidationResult) -> None:
    required = TASK_FIELDS[task]
    for line, row in parsed:
        if not isinstance(row, dict):
            result.error(line, None, "each row must be an object with named fields")
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


def validate_upload(data: bytes, fmt: str, task: str) -> ValidationResult:
    result = ValidationResult()
    if task not in TASK_FIELDS:
        result.error(None, "task", f"unknown task {task!r}; use one of {', '.join(TASK_FIELDS)}")
        return result
    parsed = _parse(data, fmt, result)
    if not result.errors and not parsed:
        result.error(None, "file", "the file has no rows")
    validate_rows(parsed, task, result)
    if result.errors:
        result.rows = []
    return result


def dataset_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    q = [len(r["question"]) for r in rows]
    a = [len(r["answer"]) for r in rows]
    return {
        "rows": len(rows),
        "question_chars": {"min": min(q), "mean": round(sum(q) / len(q), 1), "max": max(q)},
        "answer_chars": {"min": min(a), "mean": round(sum(a) / len(a), 1), "max": max(a)},
        "columns": sorted({k for r in rows for k in r}),
        "duplicate_questions": len(q) - len({r["question"] for r in rows}),
    }
