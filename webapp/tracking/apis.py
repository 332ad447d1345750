"""The tracker's endpoints: ingest for trainers and flows (authenticated by the run's ingest
token), and what a user reads of a run's tracking data (detail with latest metrics, series,
trajectories, comparisons)."""

from rest_framework import serializers
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.core.json_input import json_check
from webapp.core.params import int_param, list_param
from webapp.runs.apis import RunOutput, RunSpecOutput
from webapp.runs.auth import IngestTokenAuthentication, RunIngestUser
from webapp.runs.models import Run
from webapp.runs.selectors import run_config_diff, run_get
from webapp.runs.services import run_event_add, run_status_set
from webapp.tracking.selectors import (
    latest_metrics,
    latest_metrics_for_runs,
    metric_series_get,
    trajectory_list,
)
from webapp.tracking.services import checkpoint_record, metrics_ingest, trajectories_ingest


class IngestApi(APIView):
    authentication_classes = [IngestTokenAuthentication]

    @property
    def run(self):
        if not isinstance(self.request.user, RunIngestUser):
            raise PermissionDenied("ingest endpoints take a run ingest token")
        return self.request.auth


class MetricsIngestApi(IngestApi):
    class InputSerializer(serializers.Serializer):
        batch_id = serializers.CharField(required=False)
        points = serializers.ListField(child=serializers.DictField(), allow_empty=True)

    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        inserted = metrics_ingest(run=self.run, points=data.validated_data["points"])
        return Response({"inserted": inserted, "received": len(data.validated_data["points"])})


class EventInput(serializers.Serializer):
    kind = serializers.CharField(max_length=30, default="log")
    message = serializers.CharField(allow_blank=True, default="", max_length=20_000)
    data = serializers.DictField(required=False, default=dict)
    dedup_key = serializers.CharField(max_length=100, required=False, allow_null=True, default=None)


class EventsIngestApi(IngestApi):
    class InputSerializer(serializers.Serializer):
        events = serializers.ListField(child=EventInput(), max_length=1000)

    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        stored = 0
        for i, e in enumerate(data.validated_data["events"]):
            ev = run_event_add(run=self.run, kind=e["kind"], message=e["message"],
                               data=json_check(e["data"], f"events[{i}].data"),
                               dedup_key=e["dedup_key"])
            stored += ev is not None
        return Response({"stored": stored})


class StatusIngestApi(IngestApi):
    class InputSerializer(serializers.Serializer):
        status = serializers.ChoiceField(choices=["provisioning", "running", "succeeded", "failed",
                                                  "cancelled"])
        reason = serializers.CharField(required=False, allow_blank=True, default="")

    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        run = run_status_set(run=self.run, **data.validated_data)
        return Response({"status": run.status, "cancel_requested": run.cancel_requested})


class TrajectoriesIngestApi(IngestApi):
    class InputSerializer(serializers.Serializer):
        samples = serializers.ListField(child=serializers.DictField(), max_length=1000)

    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        return Response({"stored": trajectories_ingest(run=self.run, samples=data.validated_data["samples"])})


class CheckpointIngestApi(IngestApi):
    class InputSerializer(serializers.Serializer):
        step = serializers.IntegerField(min_value=0, max_value=2**63 - 1)
        version = serializers.IntegerField(min_value=0, max_value=2**63 - 1)
        path = serializers.CharField(max_length=1000)

    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        checkpoint_record(run=self.run, **data.validated_data)
        return Response({"ok": True})


class RunInfoIngestApi(IngestApi):
    """What the GPU side needs: the spec, the dataset rows location, cancellation."""

    def get(self, request):
        run = self.run
        # The last trained step the tracker has: the flow's heartbeat for trainers on other nodes.
        last = run.latest_metrics.filter(key="version").values_list("step", flat=True).first()
        return Response({"id": run.id, "name": run.name, "status": run.status,
                         "cancel_requested": run.cancel_requested, "spec": run.spec,
                         "attempt": run.attempt, "last_step": last,
                         "reward": {"fn": run.reward_version.fn_path,
                                    "source": run.reward_version.source}})


class DatasetRowsIngestApi(IngestApi):
    def get(self, request):
        from django.http import FileResponse

        version = self.run.dataset_version
        return FileResponse(open(version.rows_path, "rb"), content_type="application/jsonl",
                            filename=f"dataset-{version.id}.jsonl")


# ---- a user's view of a run's tracking data --------------------------------------------------


class RunDetailOutput(RunSpecOutput):
    latest_metrics = serializers.SerializerMethodField()

    def get_latest_metrics(self, run: Run) -> dict:
        return latest_metrics(run=run)


class RunDetailApi(APIView):
    def get(self, request, run_id: int):
        return Response(RunDetailOutput(run_get(user=request.user, run_id=run_id)).data)


def _keys(request, default: list[str]) -> list[str]:
    return list_param(request, "keys", max_items=50, max_length=100) or default


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
        run = run_get(user=request.user, run_id=run_id)
        samples = trajectory_list(run=run, step=int_param(request, "step"))
        return Response([{"step": s.step, "index": s.index, "prompt": s.prompt,
                          "completion": s.completion, "reward": s.reward, "tokens": s.tokens,
                          "token_versions": s.token_versions, "info": s.info} for s in samples])


class RunCompareApi(APIView):
    def get(self, request):
        try:
            ids = [int(x) for x in list_param(request, "ids", max_items=20, max_length=18) or []]
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
