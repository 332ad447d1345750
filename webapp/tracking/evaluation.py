"""Offline evaluation of a run's weights on held-out rows (a worker job: it loads a model)."""

from __future__ import annotations

from webapp.runs.models import Run
from webapp.runs.services import run_event_add
from webapp.tracking.services import metrics_ingest


def checkpoint_evaluate(*, run_id: int, checkpoint_step: int | None = None, limit: int = 200) -> dict:
    import torch
    from orchestration.trigger import flow_run_dir
    from safetensors.torch import load_file

    from training_core.checkpoint import pushed_weights
    from training_core.config import spec_from_dict
    from training_core.data.templates import prompt_template_text
    from training_core.models.loading import load_model, load_tokenizer, run_model_dir
    from training_core.rewards.registry import resolve_reward
    from webapp.datasets.selectors import dataset_version_rows

    run = Run.objects.select_related("dataset_version", "reward_version").get(id=run_id)
    run_dir = flow_run_dir(run.id)
    weights = pushed_weights(run_dir)
    if not weights:
        raise FileNotFoundError(f"no pushed weights under {run_dir / 'weights'}")
    version, wdir = weights[-1] if checkpoint_step is None else next(
        w for w in weights if w[0] == checkpoint_step)
    base = run_model_dir(spec_from_dict(run.spec), run_dir)
    model, tok = load_model(base).eval(), load_tokenizer(base)
    model.load_state_dict(load_file(str(wdir / "model.safetensors")), strict=False)
    model.tie_weights()
    spec = spec_from_dict(run.spec)
    reward = (resolve_reward(run.reward_version.fn_path, spec.reward.extract)
              if run.reward_version.builtin_name else None)
    if reward is None:
        raise ValueError("offline evaluation of user-code rewards runs in the sandbox: not supported yet")
    rows = dataset_version_rows(version=run.dataset_version)[-limit:]
    template = prompt_template_text(spec.data.prompt_template)
    scores = []
    with torch.no_grad():
        for row in rows:
            ids = tok.encode(template.format(**row), add_special_tokens=False, return_tensors="pt")
            out = model.generate(ids, max_new_tokens=run.spec["rollout"]["max_new_tokens"], do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            scores.append(float(reward(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), row)))
    accuracy = sum(s >= 1.0 - 1e-6 for s in scores) / max(len(scores), 1)
    metrics_ingest(run=run, points=[{"key": "offline_eval/accuracy", "step": version, "value": accuracy}])
    run_event_add(run=run, kind="evaluation", message=f"offline eval of v{version}: accuracy {accuracy:.3f} "
                                                      f"on {len(scores)} rows")
    return {"version": version, "accuracy": accuracy, "rows": len(scores)}
