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

from webapp.accounts.selectors import project_get_for_user, project_list
from webapp.core.errors import ApplicationError
from webapp.core.uploads import upload_check
from webapp.dashboard.formatting import glance_items, grouped_metrics
from webapp.dashboard.forms import (
    DatasetUploadForm,
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
)
from webapp.datasets.services import dataset_upload
from webapp.rewards.selectors import (
    reward_function_get,
    reward_function_list,
    reward_version_get,
    reward_version_list,
)
from webapp.rewards.services import builtin_names, reward_function_create
from webapp.runs.models import Run
from webapp.runs.selectors import run_config_diff, run_event_recent, run_get, run_list
from webapp.runs.services import run_cancel, run_create, run_resume
from webapp.tracking.selectors import (
    checkpoint_list,
    latest_metrics,
    latest_metrics_for_runs,
    run_glance,
    trajectory_steps,
)

CHARTS = [
    ("Reward and accuracy", ["reward/mean", "reward/accuracy", "eval/accuracy"]),
    ("Response length", ["response_length/mean", "response_length/max"]),
    ("Staleness (policy version lag)", ["staleness/mean", "staleness/max"]),
    ("Version lag distribution (fraction of tokens)", [f"staleness/lag_{k}_frac" for k in range(5)]),
    ("Throughput (tokens/s)", ["tokens_per_s"]),
    ("Generation vs training time (s)", ["time/generation_wait_s", "time/training_s",
                                         "time/weight_sync_pause_s"]),
    ("Loss", ["loss"]),
    ("Clip fraction", ["clip_frac"]),
    ("Behaviour weights", ["behav_weight/mean", "behav_weight/max", "behav_weight/masked_frac"]),
    ("Grad norm", ["grad_norm"]),
    ("Weight version", ["version"]),
]
LIST_KEYS = ["reward/mean", "eval/accuracy", "staleness/mean", "tokens_per_s"]


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
    return render(request, "dashboard/run_detail.html", {
        "run": run, "metric_groups": grouped_metrics(latest),
        "glance": glance_items(run_glance(run=run, latest=latest)),
        "events": run_event_recent(run=run), "live": live,
        "page_config": {"page": "run", "run_id": run.id, "charts": CHARTS, "live": live},
        "steps": trajectory_steps(run=run),
        "checkpoints": checkpoint_list(run=run),
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
def run_compare(request: HttpRequest) -> HttpResponse:
    form = RunCompareForm(request.GET)
    errors: list[dict] = []
    ids: list[int] = []
    if form.is_valid():
        try:
            ids = form.run_ids(request.GET.getlist("ids"))
        except forms.ValidationError as exc:
            errors = [{"field": "ids", "message": exc.messages[0]}]
    runs = [run_get(user=request.user, run_id=i) for i in ids]
    return render(request, "dashboard/compare.html", {"errors": errors,
        "runs": runs, "diff": run_config_diff(runs=runs) if len(runs) >= 2 else [],
        "page_config": {"page": "compare", "run_ids": [r.id for r in runs], "charts": CHARTS[:6]},
        "all_runs": run_list(user=request.user)[:100]})


@login_required
def run_new(request: HttpRequest) -> HttpResponse:
    ctx = {"projects": project_list(user=request.user), "datasets": dataset_list(user=request.user),
           "rewards": reward_function_list(user=request.user), "errors": [],
           "spec_text": request.POST.get("spec", "trainer:\n  steps: 20\n")}
    if request.method == "POST":
        form = RunNewForm(request.POST)
        if not form.is_valid():
            ctx["errors"] = form_errors(form)
            return render(request, "dashboard/run_new.html", ctx)
        data = form.cleaned_data
        try:
            run = run_create(
                project=project_get_for_user(user=request.user, project_id=data["project"]),
                user=request.user, name=data["name"].strip() or "run",
                dataset_version=dataset_version_get(user=request.user,
                                                    version_id=data["dataset_version"]),
                reward_version=reward_version_get(user=request.user,
                                                  version_id=data["reward_version"]),
                spec=data["spec"])
            return redirect("run-detail", run_id=run.id)
        except ApplicationError as exc:
            ctx["errors"] = exc.errors
    return render(request, "dashboard/run_new.html", ctx)


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
                                     data=upload.read())
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
