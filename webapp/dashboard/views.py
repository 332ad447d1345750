"""Server-rendered pages. Views only parse, call one service/selector and render; charts fetch
downsampled series from the REST API and refresh while a run is live."""

from __future__ import annotations

import json

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from training_core import metric_names as M
from webapp.accounts.selectors import project_get_for_user, project_list
from webapp.core.errors import ApplicationError
from webapp.core.params import parse_count
from webapp.core.spec_yaml import spec_to_yaml
from webapp.core.uploads import upload_check
from webapp.dashboard.charts import COMPARE_BUCKETS, COMPARE_CHARTS, RUN_BUCKETS, RUN_CHART_GROUPS
from webapp.dashboard.formatting import glance_items, grouped_metrics
from webapp.dashboard.forms import (
    CloneForm,
    DatasetUploadForm,
    DatasetVersionEvalSetForm,
    RewardCreateForm,
    RunCompareForm,
    RunListFilterForm,
    RunNewForm,
    form_errors,
)
from webapp.datasets.selectors import (
    dataset_get,
    dataset_list,
    dataset_version_get,
    dataset_version_list,
    dataset_versions_get,
)
from webapp.datasets.services import dataset_upload, dataset_version_eval_set_mark
from webapp.registry.selectors import model_version_list
from webapp.registry.services import model_version_request
from webapp.rewards.selectors import (
    reward_function_get,
    reward_function_list,
    reward_version_get,
    reward_version_list,
)
from webapp.rewards.services import builtin_names, reward_function_create
from webapp.runs.models import Run
from webapp.runs.selectors import (
    run_config_diff,
    run_eval_set_list,
    run_event_recent,
    run_gateway,
    run_get,
    run_list,
    run_spec_fields,
    run_spec_overrides,
    run_spec_resolved,
    runs_get,
)
from webapp.runs.services import run_cancel, run_create, run_resume
from webapp.sweeps.selectors import sweep_get, sweep_list, sweep_runs
from webapp.sweeps.services import MAX_RUNS, sweep_against_synchronous, sweep_create
from webapp.tracking.selectors import (
    checkpoint_list,
    latest_metric_rows,
    latest_metrics,
    latest_metrics_for_runs,
    run_eval_sets,
    run_glance,
    trajectory_steps,
)

LIST_KEYS = [M.REWARD_MEAN, M.EVAL_ACCURACY, M.STALENESS_MEAN, M.TOKENS_PER_S]


@login_required
def run_list_view(request: HttpRequest) -> HttpResponse:
    form = RunListFilterForm(request.GET)
    filters = form.cleaned_data if form.is_valid() else {}  # a bad filter shows everything
    status, search = filters.get("status") or None, filters.get("q") or None
    runs = list(run_list(user=request.user, status=status, search=search,
                         project_id=filters.get("project"))[:200])
    latest = latest_metrics_for_runs(runs=runs, keys=LIST_KEYS)
    rows = [{"run": r, "metrics": [latest[r.id].get(k) for k in LIST_KEYS]} for r in runs]
    return render(request, "dashboard/run_list.html", {
        "rows": rows, "keys": LIST_KEYS, "statuses": Run.Status.values, "status": status,
        "q": search or "", "projects": project_list(user=request.user)})


@login_required
def run_detail(request: HttpRequest, run_id: int) -> HttpResponse:
    run = run_get(user=request.user, run_id=run_id)
    latest = latest_metrics(run=run)
    live = run.status not in Run.TERMINAL
    groups = [{"id": gid, "title": title, "charts": charts} for gid, title, charts in RUN_CHART_GROUPS]
    return render(request, "dashboard/run_detail.html", {
        "run": run, "metric_groups": grouped_metrics(latest),
        "glance": glance_items(run_glance(run=run, latest=latest)),
        "events": run_event_recent(run=run), "live": live, "chart_groups": groups,
        "page_config": {"page": "run", "run_id": run.id, "groups": groups, "live": live,
                        "buckets": RUN_BUCKETS},
        "raw_metrics": latest_metric_rows(run=run),
        "eta": run_spec_resolved(run=run).rollout.max_staleness,
        "steps": trajectory_steps(run=run),
        "checkpoints": checkpoint_list(run=run),
        "models": list(model_version_list(user=request.user, run_id=run.id)[:50]),
        "gateway": run_gateway(run=run),
        "eval_sets": run_eval_set_list(run=run), "has_evals": bool(run_eval_sets(run=run)),
        "spec_json": json.dumps(run.spec, indent=2)})


def _run_action(request: HttpRequest, run_id: int, action, done: str) -> HttpResponse:
    """A button on the run page: the service decides, the page says what happened."""
    try:
        action(run=run_get(user=request.user, run_id=run_id), user=request.user)
        messages.success(request, done)
    except ApplicationError as exc:
        messages.error(request, exc.message)
    return redirect("run-detail", run_id=run_id)


@login_required
@require_POST
def run_cancel_view(request: HttpRequest, run_id: int) -> HttpResponse:
    return _run_action(request, run_id, run_cancel, "cancellation requested")


@login_required
@require_POST
def run_resume_view(request: HttpRequest, run_id: int) -> HttpResponse:
    return _run_action(request, run_id, run_resume, "resuming from the latest checkpoint")


@login_required
@require_POST
def run_sync_sweep_view(request: HttpRequest, run_id: int) -> HttpResponse:
    """'Compare with synchronous': two fresh runs of this configuration, launched together."""
    run = run_get(user=request.user, run_id=run_id)
    try:
        sweep = sweep_against_synchronous(run=run, user=request.user)
    except ApplicationError as exc:
        messages.error(request, exc.message)
        return redirect("run-detail", run_id=run_id)
    messages.success(request, f"started {sweep.runs.count()} runs, launched together with one "
                              "shared warm start")
    return redirect("sweep-detail", sweep_id=sweep.id)


@login_required
@require_POST
def run_export_view(request: HttpRequest, run_id: int) -> HttpResponse:
    """'Export': queue an export of the chosen version into the model registry."""
    version = (request.POST.get("version") or "latest").strip()[:20]
    try:
        mv = model_version_request(run=run_get(user=request.user, run_id=run_id),
                                   user=request.user, version=version)
        messages.success(request, f"export of {version} queued as model version {mv.id}")
    except ApplicationError as exc:
        messages.error(request, exc.message)
    return redirect("run-detail", run_id=run_id)


def _compare_context(runs: list[Run], focus: int | None) -> dict:
    return {"runs": runs, "diff": run_config_diff(runs=runs) if len(runs) >= 2 else [],
            "page_config": {"page": "compare", "run_ids": [r.id for r in runs], "focus": focus,
                            "charts": COMPARE_CHARTS, "buckets": COMPARE_BUCKETS}}


@login_required
def run_compare(request: HttpRequest) -> HttpResponse:
    """Compare the picked runs; one run that belongs to a sweep is compared with its sweep."""
    form = RunCompareForm(request.GET)
    errors: list[dict] = []
    ids: list[int] = []
    if form.is_valid():
        try:
            ids = form.run_ids(request.GET.getlist("ids"))
        except forms.ValidationError as exc:
            errors = [{"field": "ids", "message": exc.messages[0]}]
    runs = runs_get(user=request.user, run_ids=ids[:20])
    focus = runs[0].id if len(runs) == 1 else None
    if len(runs) == 1 and runs[0].sweep_id:
        runs = sweep_runs(sweep=runs[0].sweep)
    return render(request, "dashboard/compare.html", {
        "errors": errors, **_compare_context(runs, focus),
        "all_runs": run_list(user=request.user)[:100]})


@login_required
def sweep_list_view(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/sweep_list.html", {
        "sweeps": sweep_list(user=request.user, with_runs=True)[:200]})


@login_required
def sweep_detail(request: HttpRequest, sweep_id: int) -> HttpResponse:
    sweep = sweep_get(user=request.user, sweep_id=sweep_id)
    runs = sweep_runs(sweep=sweep)
    rows = [{"run": r, "values": [r.sweep_values.get(f) for f in sweep.fields]} for r in runs]
    return render(request, "dashboard/sweep_detail.html", {
        "sweep": sweep, "rows": rows, "base_yaml": spec_to_yaml(sweep.base_spec),
        **_compare_context(runs, None)})


def _new_run_context(request: HttpRequest, *, spec_text: str, values: dict) -> dict:
    fields = run_spec_fields(user=request.user)
    datasets = dataset_list(user=request.user)
    return {"projects": project_list(user=request.user), "datasets": datasets,
            "eval_set_choices": [v for d in datasets for v in d.versions.all() if v.is_eval_set],
            "rewards": reward_function_list(user=request.user), "errors": [],
            "spec_text": spec_text, "values": values,
            "sweepable": [f for f in fields if f["sweepable"]], "max_runs": MAX_RUNS,
            "form_config": {"fields": fields, "errors": [], "max_runs": MAX_RUNS}}


@login_required
def run_new(request: HttpRequest) -> HttpResponse:
    """The run form: generated from the run spec's schema (runform.js), a YAML view kept in
    sync both ways, inline checks as the user types; a sweep when fields to vary are given.
    ``?clone=<id>`` starts from a run's configuration."""
    if request.method != "POST":
        clone = CloneForm(request.GET)
        source = None
        if clone.is_valid() and clone.cleaned_data["clone"]:
            source = run_get(user=request.user, run_id=clone.cleaned_data["clone"])
        values = {"name": f"{source.name} (clone)"[:80] if source else "",
                  "project": source.project_id if source else None,
                  "dataset_version": source.dataset_version_id if source else None,
                  "reward_version": source.reward_version_id if source else None,
                  "eval_set_versions": ([v.id for v in run_eval_set_list(run=source)]
                                        if source else []),
                  "share_warm_start": True}
        spec = run_spec_overrides(run=source) if source else {"trainer": {"steps": 20}}
        ctx = _new_run_context(request, spec_text=spec_to_yaml(spec), values=values)
        ctx["clone"] = source
        return render(request, "dashboard/run_new.html", ctx)

    post = request.POST
    ctx = _new_run_context(request, spec_text=post.get("spec", ""), values={
        "name": post.get("name", ""), "project": _int(post.get("project")),
        "dataset_version": _int(post.get("dataset_version")),
        "reward_version": _int(post.get("reward_version")),
        "eval_set_versions": [i for i in map(_int, post.getlist("eval_set_versions")) if i],
        "share_warm_start": bool(post.get("share_warm_start")),
        **{f"sweep_{kind}_{i}": post.get(f"sweep_{kind}_{i}", "")
           for kind in ("field", "values") for i in (1, 2)}})
    form = RunNewForm(post)
    if not form.is_valid():
        return _run_new_errors(request, ctx, form_errors(form))
    data = form.cleaned_data
    try:
        project = project_get_for_user(user=request.user, project_id=data["project"])
        dataset_version = dataset_version_get(user=request.user, version_id=data["dataset_version"])
        reward_version = reward_version_get(user=request.user, version_id=data["reward_version"])
        eval_sets = dataset_versions_get(user=request.user, version_ids=data["eval_set_versions"])
        name = data["name"].strip() or "run"
        if data["axes"]:
            sweep = sweep_create(project=project, user=request.user, name=name,
                                 dataset_version=dataset_version, reward_version=reward_version,
                                 spec=data["spec"], axes=data["axes"],
                                 share_warm_start=data["share_warm_start"],
                                 eval_set_versions=eval_sets)
            return redirect("sweep-detail", sweep_id=sweep.id)
        run = run_create(project=project, user=request.user, name=name,
                         dataset_version=dataset_version, reward_version=reward_version,
                         spec=data["spec"], eval_set_versions=eval_sets)
        return redirect("run-detail", run_id=run.id)
    except ApplicationError as exc:
        return _run_new_errors(request, ctx, exc.errors, status=exc.status_code)


def _run_new_errors(request: HttpRequest, ctx: dict, errors: list[dict],
                    status: int = 400) -> HttpResponse:
    """The form again, as the user filled it, with each error next to its field."""
    ctx["errors"] = errors
    ctx["form_config"]["errors"] = errors
    return render(request, "dashboard/run_new.html", ctx, status=status)


def _int(value: str | None) -> int | None:
    return parse_count(value)  # ASCII digits, 64-bit; anything else shows the field empty


def _upload_refused(request: HttpRequest, template: str, ctx: dict) -> HttpResponse | None:
    """The form page again with the 413's message when the upload went over the cap."""
    try:
        upload_check(request)
    except ApplicationError as exc:
        return render(request, template, {**ctx, "errors": exc.errors}, status=exc.status_code)
    return None


@login_required
def dataset_list_view(request: HttpRequest) -> HttpResponse:
    ctx = {"datasets": dataset_list(user=request.user),
           "projects": project_list(user=request.user), "errors": []}
    if request.method == "POST":
        form = DatasetUploadForm(request.POST, request.FILES)
        if (refused := _upload_refused(request, "dashboard/dataset_list.html", ctx)):
            return refused
        if not form.is_valid():
            ctx["errors"] = form_errors(form)
            return render(request, "dashboard/dataset_list.html", ctx)
        data, upload = form.cleaned_data, form.cleaned_data["file"]
        try:
            project = project_get_for_user(user=request.user, project_id=data["project"])
            version = dataset_upload(project=project, user=request.user, name=data["name"].strip(),
                                     task=data["task"] or "qa", filename=upload.name,
                                     data=upload.read(), is_eval_set=data["is_eval_set"])
            messages.success(request, f"stored {version} ({version.row_count} rows)")
            return redirect("dataset-detail", dataset_id=version.dataset_id)
        except ApplicationError as exc:
            ctx["errors"] = exc.errors
    return render(request, "dashboard/dataset_list.html", ctx)


@login_required
def dataset_detail(request: HttpRequest, dataset_id: int) -> HttpResponse:
    dataset = dataset_get(user=request.user, dataset_id=dataset_id)
    versions = dataset_version_list(dataset=dataset)
    return render(request, "dashboard/dataset_detail.html", {"dataset": dataset, "versions": versions,
                                                              "latest": versions[0] if versions else None})


@login_required
@require_POST
def dataset_version_eval_set_view(request: HttpRequest, dataset_id: int) -> HttpResponse:
    """'Eval set' on a dataset's page: mark a version as an eval set (runs may attach it), or
    unmark it."""
    dataset = dataset_get(user=request.user, dataset_id=dataset_id)
    form = DatasetVersionEvalSetForm(request.POST)
    if not form.is_valid():
        messages.error(request, "; ".join(f"{e['field']}: {e['message']}" for e in form_errors(form)))
        return redirect("dataset-detail", dataset_id=dataset.id)
    version = dataset_version_get(user=request.user, version_id=form.cleaned_data["version"])
    if version.dataset_id != dataset.id:
        messages.error(request, "version: not a version of this dataset")
        return redirect("dataset-detail", dataset_id=dataset.id)
    marked = form.cleaned_data["is_eval_set"]
    dataset_version_eval_set_mark(version=version, is_eval_set=marked)
    messages.success(request, f"{version} is {'now' if marked else 'no longer'} an eval set")
    return redirect("dataset-detail", dataset_id=dataset.id)


REWARD_TEMPLATE = (
    "def reward(completion: str, item: dict) -> float:\n"
    "    # item is the dataset row (question, answer, ...); return a score\n"
    "    return float(completion.strip() == str(item[\"answer\"]).strip())\n"
)


@login_required
def reward_list_view(request: HttpRequest) -> HttpResponse:
    """List, plus a browser editor (or a file upload) for user reward code."""
    ctx = {"rewards": reward_function_list(user=request.user),
           "projects": project_list(user=request.user), "builtins": builtin_names(), "errors": [],
           "source": request.POST.get("source") or REWARD_TEMPLATE}
    if request.method == "POST":
        form = RewardCreateForm(request.POST, request.FILES)
        if (refused := _upload_refused(request, "dashboard/reward_list.html", ctx)):
            return refused
        if not form.is_valid():
            ctx["errors"] = form_errors(form)
            return render(request, "dashboard/reward_list.html", ctx)
        data = form.cleaned_data
        upload = data["file"]
        source = upload.read().decode("utf-8", errors="replace") if upload else data["source"]
        builtin = data["builtin"] or None
        try:
            project = project_get_for_user(user=request.user, project_id=data["project"])
            version = reward_function_create(
                project=project, user=request.user, name=data["name"].strip(), builtin=builtin,
                source=None if builtin else source,
                entrypoint=data["entrypoint"].strip() or "reward")
            messages.success(request, f"saved v{version.version} ({version.status}); "
                                      "a worker validates user code in its sandbox")
            return redirect("reward-detail", reward_id=version.reward_function_id)
        except ApplicationError as exc:
            ctx["errors"], ctx["source"] = exc.errors, source
    return render(request, "dashboard/reward_list.html", ctx)


@login_required
def reward_detail(request: HttpRequest, reward_id: int) -> HttpResponse:
    rf = reward_function_get(user=request.user, reward_id=reward_id)
    return render(request, "dashboard/reward_detail.html",
                  {"reward": rf, "versions": reward_version_list(reward_function=rf)})
