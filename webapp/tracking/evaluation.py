"""Offline evaluation of a run's pushed weights on held-out rows of its dataset.

The model work is the engine's (``training_core.offline_eval.evaluate_weights``, the same prompt
rendering and reward extraction as training); this service picks the weights and rows and records
the result. It runs in a worker (the ``oolong.evaluation_run`` task), never in a web process.
"""

from __future__ import annotations

from training_core import metric_names as M
from webapp.core.errors import ApplicationError
from webapp.datasets.selectors import dataset_version_rows
from webapp.runs.models import Run
from webapp.runs.selectors import run_spec_resolved
from webapp.runs.services import run_event_add
from webapp.tracking.services import metrics_ingest


def checkpoint_evaluate(*, run_id: int, checkpoint_step: int | None = None, limit: int = 200) -> dict:
    from orchestration.trigger import flow_run_dir

    from training_core.checkpoint import pushed_weights
    from training_core.models.paths import run_model_dir
    from training_core.offline_eval import evaluate_weights

    run = Run.objects.select_related("dataset_version", "reward_version").get(id=run_id)
    if not run.reward_version.builtin_name:
        raise ApplicationError("offline evaluation of user-code rewards runs in the sandbox: "
                               "not supported yet", field="reward_version")
    spec = run_spec_resolved(run=run)
    run_dir = flow_run_dir(run.id)
    weights = dict(pushed_weights(run_dir))
    if not weights:
        raise ApplicationError(f"no pushed weights under {run_dir / 'weights'}", field="run")
    version = max(weights) if checkpoint_step is None else checkpoint_step
    if version not in weights:
        raise ApplicationError(f"no weights of version {version}; have {sorted(weights)}",
                               field="checkpoint_step")
    rows = dataset_version_rows(version=run.dataset_version)[-limit:]
    metrics = evaluate_weights(spec, run_model_dir(spec, run_dir), weights[version], rows)
    accuracy = metrics[M.OFFLINE_EVAL_ACCURACY]
    metrics_ingest(run=run, points=[{"key": k, "step": version, "value": v}
                                    for k, v in metrics.items() if k != M.OFFLINE_EVAL_ROWS])
    run_event_add(run=run, kind="evaluation", message=f"offline eval of v{version}: accuracy "
                                                      f"{accuracy:.3f} on {len(rows)} rows")
    return {"version": version, "accuracy": accuracy, "rows": len(rows)}
