"""Running reward code, only ever from a worker: sandboxed validation and remote scoring."""

from __future__ import annotations

from typing import Any

from webapp.rewards.models import RewardFunctionVersion
from webapp.rewards.services import reward_validation_record

# What a task may ask of the worker's jail: the deadline under the task's own soft limit
# (workers/tasks.py), so the jail answers first; the memory within what a run spec accepts.
MAX_REMOTE_TIMEOUT_S = 290.0
MAX_REMOTE_MEMORY_MB = 262144

SAMPLE_ROWS = 8


def _sample_rows(version: RewardFunctionVersion) -> list[dict[str, Any]]:
    """Rows from the project's newest dataset, else small generic ones."""
    from webapp.datasets.models import DatasetVersion
    from webapp.datasets.selectors import dataset_version_rows

    latest = (DatasetVersion.objects.filter(dataset__project=version.reward_function.project)
              .order_by("-created_at").first())
    rows = dataset_version_rows(version=latest, limit=SAMPLE_ROWS) if latest else [
        {"question": "1+1=", "answer": "2"}, {"question": "2+3=", "answer": "5"}]
    # Score the gold answer and a wrong one: a useful reward tells them apart.
    out = []
    for r in rows:
        out.append({**r, "completion": str(r["answer"])})
        out.append({**r, "completion": "no idea"})
    return out


def reward_version_validate(*, version_id: int) -> dict[str, Any]:
    from training_core.sandbox import run_sandboxed

    version = RewardFunctionVersion.objects.select_related("reward_function__project").get(id=version_id)
    if version.status != RewardFunctionVersion.Status.PENDING:
        return version.validation_report  # already validated: idempotent
    rows = _sample_rows(version)
    report = run_sandboxed(version.source, version.entrypoint, rows)
    report["samples"] = [{"completion": r["completion"][:200], "answer": str(r.get("answer"))[:200], **res}
                         for r, res in zip(rows, report.pop("results"), strict=False)]
    reward_validation_record(version=version, report=report)
    return report


def reward_score_remote(*, fn_path: str, source: str, completion: str, item: dict[str, Any],
                        extract: str = "auto", timeout_s: float = 10.0,
                        memory_mb: int | None = None) -> dict:
    if fn_path.startswith("builtin:"):
        from training_core.rewards.registry import resolve_reward

        try:
            return {"reward": float(resolve_reward(fn_path, extract)(completion, item))}
        except Exception as exc:  # noqa: BLE001 - a failed reward scores 0 upstream
            return {"reward": 0.0, "error": f"{type(exc).__name__}: {exc}"}
    from training_core.sandbox import run_sandboxed

    entrypoint = fn_path.rsplit(":", 1)[-1]
    report = run_sandboxed(source, entrypoint, [{**item, "completion": completion}],
                           timeout_s=min(float(timeout_s), MAX_REMOTE_TIMEOUT_S),
                           memory_mb=min(int(memory_mb), MAX_REMOTE_MEMORY_MB) if memory_mb else None)
    result = (report.get("results") or [{}])[0]
    return {"reward": float(result.get("reward", 0.0)), "error": report.get("error") or result.get("error")}
