from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.api.params import int_param

from webapp.accounts.selectors import project_get_for_user
from webapp.datasets.selectors import dataset_version_get
from webapp.rewards.selectors import reward_version_get
from webapp.runs.models import Run
from webapp.runs.selectors import run_config_diff, run_get, run_list
from webapp.runs.services import run_cancel, run_create
from webapp.tracking.selectors import latest_metrics, latest_metrics_for_runs, metric_series_get


class RunOutput(serializers.Serializer):
    id = serializers.IntegerField()
    project_id = serializers.IntegerField()
    name = serializers.CharField()
    status = serializers.CharField()
    status_reason = serializers.CharField()
    cancel_requested = serializers.BooleanField()
    dataset_version_id = serializers.IntegerField()
    reward_version_id = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    started_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField()
    duration_s = serializers.FloatField()


class RunDetailOutput(RunOutput):
    spec = serializers.JSONField()
    latest_metrics = serializers.SerializerMethodField()

    def get_latest_metrics(self, run: Run) -> dict:
        return latest_metrics(run=run)


class RunListApi(APIView):
    def get(self, request):
        q = request.query_params
        qs = run_list(user=request.user, project_id=int_param(request, "project"),
                      status=q.get("status"), search=q.get("search"))
        page = LimitOffsetPagination()
        items = page.paginate_queryset(qs, request, view=self)
        return page.get_paginated_response(RunOutput(items, many=True).data)


class RunCreateApi(APIView):
    class InputSerializer(serializers.Serializer):
        project = serializers.IntegerField()
        name = serializers.CharField(max_length=100)
        dataset_version = serializers.IntegerField()
        reward_version = serializers.IntegerField()
        spec = serializers.JSONField(required=False, default=dict)

    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        project = project_get_for_user(user=request.user, project_id=v["project"])
        run = run_create(project=project, user=request.user, name=v["name"],
                         dataset_version=dataset_version_get(user=request.user, version_id=v["dataset_version"]),
                         reward_version=reward_version_get(user=request.user, version_id=v["reward_version"]),
                         spec=v["spec"])
        out = RunDetailOutput(run).data
        out["ingest_token"] = run.ingest_token  # shown once, to the creator
        return Response(out, status=201)


class RunDetailApi(APIView):
    def get(self, request, run_id: int):
        return Response(RunDetailOutput(run_get(user=request.user, run_id=run_id)).data)


class RunCancelApi(APIView):
    def post(self, request, run_id: int):
        run = run_cancel(run=run_get(user=request.user, run_id=run_id), user=request.user)
        return Response(RunOutput(run).data, status=202)


class RunEventsApi(APIView):
    def get(self, request, run_id: int):
        run = run_get(user=request.user, run_id=run_id)
        after = int(request.query_params.get("after", 0))
        events = run.events.filter(id__gt=after).order_by("id")[:500]
        return Response([{"id": e.id, "time": e.time, "kind": e.kind, "message": e.message,
                          "data": e.data} for e in events])


def _keys(request, default: list[str]) -> list[str]:
    raw = request.query_params.get("keys")
    return [k for k in raw.split(",") if k] if raw else default


def _buckets(request) -> int:
    try:
        buckets = int(request.query_params.get("buckets", 500))
    except ValueError:
        raise ValidationError({"buckets": "must be an integer"}) from None
    if not 1 <= buckets <= 5000:
        raise ValidationError({"buckets": "must be between 1 and 5000"})
    return buckets


class RunMetricsApi(APIView):
    """Downsampled series (min/max/mean per step bucket) for the given metric keys."""

    def get(self, request, run_id: int):
        run = run_get(user=request.user, run_id=run_id)
        keys = _keys(request, ["reward/mean"])
        buckets = _buckets(request)
        return Response({"run": run.id, "series": [metric_series_get(run=run, key=k, buckets=buckets)
                                                   for k in keys]})


class RunTrajectoriesApi(APIView):
    def get(self, request, run_id: int):
        from webapp.tracking.selectors import trajectory_list

        run = run_get(user=request.user, run_id=run_id)
        step = request.query_params.get("step")
        samples = trajectory_list(run=run, step=int(step) if step else None)
        return Response([{"step": s.step, "index": s.index, "prompt": s.prompt,
                          "completion": s.completion, "reward": s.reward, "tokens": s.tokens,
                          "token_versions": s.token_versions, "info": s.info} for s in samples])


class RunCompareApi(APIView):
    def get(self, request):
        try:
            ids = [int(x) for x in request.query_params.get("ids", "").split(",") if x]
        except ValueError:
            raise ValidationError({"ids": "comma-separated run ids"}) from None
        if len(ids) < 2:
            raise ValidationError({"ids": "give at least two run ids"})
        runs = [run_get(user=request.user, run_id=i) for i in ids]
        keys = _keys(request, ["reward/mean", "eval/accuracy"])
        return Response({
            "runs": RunOutput(runs, many=True).data,
            "config_diff": run_config_diff(runs=runs),
            "latest": latest_metrics_for_runs(runs=runs, keys=keys),
            "series": {r.id: [metric_series_get(run=r, key=k, buckets=_buckets(request)) for k in keys]
                       for r in runs},
        })
