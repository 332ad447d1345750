"""Running reward code, only ever from a worker: sandboxed validation and remote scoring."""

from __future__ import annotations

import math
import os
from typing import Any

from training_core.jail import Limits
from webapp.rewards.models import RewardFunctionVersion
from webapp.rewards.services import reward_validation_record

# What a task may ask of this worker's jail. The deadline stays under the task's own soft limit
# (workers/tasks.py REWARD_SCORE_LIMITS: 300 s), so the jail answers first. The memory is the
# worker's to grant: the pool serves every project, so a run asking more than the operator allows
# (OOLONG_REWARD_MAX_MEMORY_MB, default the jail's 2048) gets a failed call naming both.
MAX_REMOTE_TIMEOUT_S = 285.0
DEFAULT_TIMEOUT_S = 10.0
MAX_MEMORY_ENV = "OOLONG_REWARD_MAX_MEMORY_MB"


def _remote_limits(timeout_s: object, memory_mb: object) -> tuple[float, int | None, str | None]:
    """The deadline and memory a task asked for, as the worker grants them, or an error: the
    values come off the broker (a NaN, a string, a negative number must not reach the jail)."""
    try:
        timeout = float(timeout_s)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        timeout = DEFAULT_TIMEOUT_S
    if not math.isfinite(timeout) or timeout <= 0:
        timeout = DEFAULT_TIMEOUT_S
    timeout = min(timeout, MAX_REMOTE_TIMEOUT_S)
    if memory_mb is None:
        return timeout, None, None
    allowed = int(os.environ.get(MAX_MEMORY_ENV) or Limits.memory_mb)
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 256:
        return timeout, None, f"reward.memory_mb must be a whole number of MB >= 256, got {memory_mb!r}"
    if memory_mb > allowed:
        return timeout, None, (f"reward.memory_mb asks {memory_mb} MB; this reward worker allows at "
                               f"most {allowed} ({MAX_MEMORY_ENV} on the worker)")
    return timeout, memory_mb, None

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
                        extract: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
                        memory_mb: int | None = None) -> dict:
    timeout, memory, refused = _remote_limits(timeout_s, memory_mb)
    if refused:
        return {"reward": 0.0, "error": refused}
    if fn_path.startswith("builtin:"):
        from training_core.rewards.registry import resolve_reward

        try:
            return {"reward": float(resolve_reward(fn_path, extract)(completion, item))}
        except Exception as exc:  # noqa: BLE001 - a failed reward scores 0 upstream
            return {"reward": 0.0, "error": f"{type(exc).__name__}: {exc}"}
    from training_core.sandbox import run_sandboxed

    entrypoint = fn_path.rsplit(":", 1)[-1]
    report = run_sandboxed(source, entrypoint, [{**item, "completion": completion}],
                           timeout_s=timeout, memory_mb=memory)
    result = (report.get("results") or [{}])[0]
    return {"reward": float(result.get("reward", 0.0)), "error": report.get("error") or result.get("error")}
