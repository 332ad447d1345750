"""The tracker's endpoints: ingest for trainers and flows (authenticated by the run's ingest
token), and what a user reads of a run's tracking data (detail with latest metrics, series,
trajectories, comparisons)."""

import math

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
)
from rest_framework import serializers
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.renderers import BrowsableAPIRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from training_core import metric_names as M
from webapp.core.fields import BoundedText
from webapp.core.params import int_param, list_param
from webapp.core.renderers import FastJSONRenderer
from webapp.core.schema import errors, int_query, str_query
from webapp.runs.apis import RunOutput, RunSpecOutput
from webapp.runs.auth import IngestRateThrottle, IngestTokenAuthentication, RunIngestUser
from webapp.runs.models import Run
from webapp.runs.selectors import run_config_diff, run_gateway, run_get, runs_get
from webapp.runs.services import run_event_add, run_status_set, run_token_issue
from webapp.tracking.selectors import (
    EVAL_CHART_METRICS,
    X_AXES,
    latest_metrics,
    latest_metrics_for_runs,
    run_eval_series,
    run_last_step,
    run_series,
    runs_compare,
    runs_eval_compare,
    trajectory_list,
)
from webapp.tracking.services import (
    checkpoint_record,
    events_ingest,
    metrics_ingest,
    trajectories_ingest,
)


class IngestApi(APIView):
    authentication_classes = [IngestTokenAuthentication]
    throttle_classes = [IngestRateThrottle]  # per run token (issue 47)

    @property
    def run(self):
        if not isinstance(self.request.user, RunIngestUser):
            raise PermissionDenied("ingest endpoints take a run ingest token")
        return self.request.auth


INGEST_ERRORS = errors(400, 401, 413, 429)


class PointInput(serializers.Serializer):
    """Documents a point; the service checks each one and names the bad one (points[3].step)."""

    key = BoundedText(max_length=100)
    step = serializers.IntegerField(min_value=-(2**63), max_value=2**63 - 1)
    value = serializers.FloatField(allow_null=True, help_text=(
        "null: a value the trainer could not send (NaN or infinite), skipped"))
    time = serializers.FloatField(required=False, help_text="Unix seconds; default: now")


class MetricsIngestApi(IngestApi):
    class InputSerializer(serializers.Serializer):
        batch_id = serializers.CharField(required=False)
        # Items unchecked here: the service checks each point and names the bad one, and DRF's
        # per-value checks of 5,000-point dicts cost a quarter of the request.
        points = serializers.ListField(allow_empty=True)

    class SchemaInput(serializers.Serializer):
        batch_id = serializers.CharField(required=False)
        points = PointInput(many=True)

    class Output(serializers.Serializer):
        inserted = serializers.IntegerField(help_text="points new or changed")
        received = serializers.IntegerField()

    @extend_schema(operation_id="ingest_metrics", request=SchemaInput,
                   responses={200: Output, **INGEST_ERRORS})
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        inserted = metrics_ingest(run=self.run, points=data.validated_data["points"])
        return Response({"inserted": inserted, "received": len(data.validated_data["points"])})


class EventInput(serializers.Serializer):
    kind = BoundedText(max_length=30, default="log")
    message = serializers.CharField(allow_blank=True, default="", max_length=20_000)
    data = serializers.DictField(required=False, default=dict)
    dedup_key = BoundedText(max_length=100, required=False, allow_null=True, default=None)


class StoredOutput(serializers.Serializer):
    stored = serializers.IntegerField()


class EventsIngestApi(IngestApi):
    class InputSerializer(serializers.Serializer):
        events = serializers.ListField(child=EventInput(), max_length=1000)

    @extend_schema(operation_id="ingest_events", request=InputSerializer,
                   responses={200: StoredOutput, **INGEST_ERRORS})
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        return Response({"stored": events_ingest(run=self.run,
                                                 events=data.validated_data["events"])})


class StatusIngestApi(IngestApi):
    class InputSerializer(serializers.Serializer):
        status = serializers.ChoiceField(choices=["provisioning", "running", "succeeded", "failed",
                                                  "cancelled"])
        reason = serializers.CharField(required=False, allow_blank=True, default="")

    class Output(serializers.Serializer):
        status = serializers.CharField()
        cancel_requested = serializers.BooleanField()

    @extend_schema(operation_id="ingest_status", request=InputSerializer,
                   responses={200: Output, **INGEST_ERRORS})
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        run = run_status_set(run=self.run, **data.validated_data)
        return Response({"status": run.status, "cancel_requested": run.cancel_requested})


class SampleInput(serializers.Serializer):
    """Documents a sample; the service checks each one and names the bad one."""

    step = serializers.IntegerField(min_value=-(2**63), max_value=2**63 - 1)
    index = serializers.IntegerField(required=False, min_value=0, max_value=2**31 - 1)
    prompt = serializers.CharField(allow_blank=True)
    completion = serializers.CharField(allow_blank=True)
    reward = serializers.FloatField()
    tokens = serializers.ListField(child=serializers.JSONField(), required=False)
    token_versions = serializers.ListField(child=serializers.IntegerField(), required=False)
    info = serializers.DictField(required=False)


class TrajectoriesIngestApi(IngestApi):
    class InputSerializer(serializers.Serializer):
        samples = serializers.ListField(child=serializers.DictField(), max_length=1000)

    class SchemaInput(serializers.Serializer):
        samples = SampleInput(many=True, max_length=1000)

    @extend_schema(operation_id="ingest_trajectories", request=SchemaInput,
                   responses={200: StoredOutput, **INGEST_ERRORS})
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        return Response({"stored": trajectories_ingest(run=self.run, samples=data.validated_data["samples"])})


class CheckpointIngestApi(IngestApi):
    class InputSerializer(serializers.Serializer):
        step = serializers.IntegerField(min_value=0, max_value=2**63 - 1)
        version = serializers.IntegerField(min_value=0, max_value=2**63 - 1)
        path = BoundedText(max_length=1000)

    class Output(serializers.Serializer):
        ok = serializers.BooleanField()

    @extend_schema(operation_id="ingest_checkpoint", request=InputSerializer,
                   responses={200: Output, **INGEST_ERRORS})
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        checkpoint_record(run=self.run, **data.validated_data)
        return Response({"ok": True})


class RunRewardOutput(serializers.Serializer):
    fn = serializers.CharField()
    source = serializers.CharField(allow_blank=True)


class RunSweepOutput(serializers.Serializer):
    id = serializers.IntegerField()
    share_warm_start = serializers.BooleanField()


class RunEvalSetIngestOutput(serializers.Serializer):
    name = serializers.CharField(help_text="the spec's eval.sets entry of this name")
    dataset_version = serializers.IntegerField()


class RunInfoIngestApi(IngestApi):
    """What the GPU side needs: the spec, the dataset rows location, cancellation."""

    class Output(serializers.Serializer):
        id = serializers.IntegerField()
        name = serializers.CharField()
        status = serializers.CharField()
        cancel_requested = serializers.BooleanField()
        spec = serializers.JSONField()
        attempt = serializers.IntegerField()
        last_step = serializers.IntegerField(allow_null=True)
        reward = RunRewardOutput()
        sweep = RunSweepOutput(allow_null=True, help_text="the run's sweep, if any")
        gateway_key = serializers.CharField(allow_blank=True, help_text=(
            "online mode: the run key its gateway accepts (empty otherwise)"))
        eval_sets = RunEvalSetIngestOutput(many=True, help_text=(
            "the run's eval sets: fetch each one's rows from /api/ingest/eval-sets/<id>/"))

    # Every IngestApi is throttled per run token: each documents the 429 (schemathesis checks it).
    @extend_schema(operation_id="ingest_run_retrieve", responses={200: Output, **errors(401, 429)})
    def get(self, request):
        run = self.run
        # The last trained step the tracker has: the flow's heartbeat for trainers on other nodes.
        return Response({"id": run.id, "name": run.name, "status": run.status,
                         "cancel_requested": run.cancel_requested, "spec": run.spec,
                         "attempt": run.attempt, "last_step": run_last_step(run=run),
                         "reward": {"fn": run.reward_version.fn_path,
                                    "source": run.reward_version.source},
                         "sweep": ({"id": run.sweep.id, "share_warm_start": run.sweep.share_warm_start}
                                   if run.sweep else None),
                         "gateway_key": run.gateway_key,
                         "eval_sets": [{"name": e.name, "dataset_version": e.dataset_version_id}
                                       for e in run.eval_sets.all()]})


class DatasetRowsIngestApi(IngestApi):
    @extend_schema(operation_id="ingest_dataset_rows", responses={
        (200, "application/jsonl"): OpenApiResponse(OpenApiTypes.BINARY, description="one JSON row per line"),
        **errors(401, 429)})
    def get(self, request):
        from django.http import FileResponse

        version = self.run.dataset_version
        return FileResponse(open(version.rows_path, "rb"), content_type="application/jsonl",
                            filename=f"dataset-{version.id}.jsonl")


class EvalSetRowsIngestApi(IngestApi):
    """The rows of an eval set attached to the run (only those: any other version is a 404)."""

    @extend_schema(operation_id="ingest_eval_set_rows", responses={
        (200, "application/jsonl"): OpenApiResponse(OpenApiTypes.BINARY, description="one JSON row per line"),
        **errors(401, 404, 429)})
    def get(self, request, version_id: int):
        from django.http import FileResponse, Http404

        attached = (self.run.eval_sets.select_related("dataset_version")
                    .filter(dataset_version_id=version_id).first())
        if attached is None:
            raise Http404("no eval set of this run has that dataset version")
        version = attached.dataset_version
        return FileResponse(open(version.rows_path, "rb"), content_type="application/jsonl",
                            filename=f"eval-set-{version.id}.jsonl")


# ---- a user's view of a run's tracking data --------------------------------------------------


class NodeCredentialIngestApi(IngestApi):
    """A credential of the run for its nodes, issued to the run's flow only: the ingest
    endpoints of this run and nothing else, void once the run ends. The flow hands it to each
    node process sealed with the run's node key (platform/orchestration/sealing.py), so no
    other run's node can read it through Prefect's API."""

    class InputSerializer(serializers.Serializer):
        provider = serializers.ChoiceField(choices=["static", "terraform"], required=False,
                                           help_text="whose nodes get it (the run's events say)")

    class Output(serializers.Serializer):
        credential = serializers.CharField(help_text="shown once; only its hash is kept")

    @extend_schema(operation_id="ingest_node_credential", request=InputSerializer,
                   responses={201: Output, **errors(400, 401, 403, 429)})
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        if self.request.user.purpose != "orchestrator":
            raise PermissionDenied("only the run's flow (its orchestrator token) may issue its "
                                   "nodes' credential")
        credential = run_token_issue(run=self.run, purpose="node")
        where = data.validated_data.get("provider")
        run_event_add(run=self.run, kind="credential", message="a credential for the run's "
                      + (f"{where} " if where else "") + "nodes was issued to its flow")
        return Response({"credential": credential}, status=201)


class RunGatewayOutput(serializers.Serializer):
    url = serializers.CharField(allow_null=True, help_text="null until the trainer's gateway is up")
    run_key = serializers.CharField()


class RunDetailOutput(RunSpecOutput):
    latest_metrics = serializers.SerializerMethodField()
    gateway = serializers.SerializerMethodField(help_text=(
        "online mode (rollout.mode: online): where external agents connect, and the run key "
        "they present; null for other runs"))

    @extend_schema_field(serializers.DictField(child=serializers.FloatField()))
    def get_latest_metrics(self, run: Run) -> dict:
        return latest_metrics(run=run)

    @extend_schema_field(RunGatewayOutput(allow_null=True))
    def get_gateway(self, run: Run) -> dict | None:
        return run_gateway(run=run)


class RunDetailApi(APIView):
    @extend_schema(operation_id="runs_retrieve", responses={200: RunDetailOutput, **errors(401, 404)})
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


def _x(request) -> str:
    x = request.query_params.get("x", "step")
    if x not in X_AXES:
        raise ValidationError({"x": f"must be one of {', '.join(X_AXES)}"})
    return x


class SeriesOutput(serializers.Serializer):
    key = serializers.CharField()
    step = serializers.ListField(child=serializers.IntegerField())
    mean = serializers.ListField(child=serializers.FloatField())
    min = serializers.ListField(child=serializers.FloatField())
    max = serializers.ListField(child=serializers.FloatField())
    x = serializers.ListField(child=serializers.FloatField(), help_text="each point's x value")
    downsampled = serializers.BooleanField()


KEYS = str_query("keys", "comma-separated metric keys (at most 50)")
BUCKETS = int_query("buckets", "points per series (default 500)", minimum=1, maximum=5000)
X_AXIS = str_query("x", "x-axis: step (default), time (seconds since the run's first step) or "
                        "tokens (consumed so far)", list(X_AXES))


# The chart reads answer long lists of floats: encoded by orjson (webapp/core/renderers.py).
CHART_RENDERERS = [FastJSONRenderer, BrowsableAPIRenderer]


class RunMetricsApi(APIView):
    """Downsampled series (min/max/mean per step bucket) for the given metric keys."""

    renderer_classes = CHART_RENDERERS

    class Output(serializers.Serializer):
        run = serializers.IntegerField()
        series = SeriesOutput(many=True)

    @extend_schema(operation_id="runs_metrics_retrieve", parameters=[KEYS, BUCKETS, X_AXIS],
                   responses={200: Output, **errors(400, 401, 404)})
    def get(self, request, run_id: int):
        run = run_get(user=request.user, run_id=run_id)
        series = run_series(run=run, keys=_keys(request, [M.REWARD_MEAN]),
                            buckets=_buckets(request), x=_x(request))
        return Response({"run": run.id, "series": series})


class TrajectoryOutput(serializers.Serializer):
    step = serializers.IntegerField()
    index = serializers.IntegerField()
    prompt = serializers.CharField(allow_blank=True)
    completion = serializers.CharField(allow_blank=True)
    reward = serializers.FloatField()
    tokens = serializers.ListField(child=serializers.JSONField())
    token_versions = serializers.ListField(child=serializers.JSONField())
    info = serializers.JSONField()


class RunTrajectoriesApi(APIView):
    @extend_schema(operation_id="runs_trajectories_list",
                   parameters=[int_query("step", "this step's samples (default: the latest step)")],
                   responses={200: TrajectoryOutput(many=True), **errors(400, 401, 404)})
    def get(self, request, run_id: int):
        run = run_get(user=request.user, run_id=run_id)
        samples = trajectory_list(run=run, step=int_param(request, "step"))
        return Response([{"step": s.step, "index": s.index, "prompt": s.prompt,
                          "completion": s.completion, "reward": s.reward, "tokens": s.tokens,
                          "token_versions": s.token_versions, "info": s.info} for s in samples])


class DiffRowOutput(serializers.Serializer):
    key = serializers.CharField()
    values = serializers.ListField(child=serializers.JSONField(allow_null=True))
    differs = serializers.BooleanField()


class SummaryRowOutput(serializers.Serializer):
    run_id = serializers.IntegerField()
    name = serializers.CharField()
    status = serializers.CharField()
    steps = serializers.IntegerField(allow_null=True)
    wall_s = serializers.FloatField(allow_null=True, help_text="first to last step")
    final_reward = serializers.FloatField(allow_null=True, help_text="mean of the last 10 steps")
    final_eval = serializers.FloatField(allow_null=True)
    best_eval = serializers.FloatField(allow_null=True)
    best_eval_step = serializers.IntegerField(allow_null=True)
    tokens_per_s = serializers.FloatField(allow_null=True, help_text="mean over the run")
    time_to_target_s = serializers.FloatField(allow_null=True, help_text="null: never reached")
    step_to_target = serializers.IntegerField(allow_null=True)


class SummaryOutput(serializers.Serializer):
    target = serializers.FloatField(allow_null=True, help_text="the reward the times are to")
    rows = SummaryRowOutput(many=True)


class CompareOutput(serializers.Serializer):
    runs = RunOutput(many=True)
    config_diff = DiffRowOutput(many=True)
    latest = serializers.JSONField(help_text="run id -> metric key -> latest value")
    series = serializers.JSONField(help_text="run id -> list of series as in /metrics/")
    summary = SummaryOutput()


TARGET = OpenApiParameter("target", {"type": "number"}, OpenApiParameter.QUERY, required=False,
                          description="reward to time (default: 90% of the best final reward)")


def _target(request) -> float | None:
    raw = request.query_params.get("target")
    if raw in (None, ""):
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValidationError({"target": "must be a number"}) from None
    if not math.isfinite(value):
        raise ValidationError({"target": "must be a finite number"})
    return value


def compare_response(request, runs: list[Run]) -> dict:
    """The comparison of ``runs`` as /api/runs/compare/ answers it (the sweep compare too)."""
    keys = _keys(request, [M.REWARD_MEAN, M.EVAL_ACCURACY])
    buckets, x, target = _buckets(request), _x(request), _target(request)
    return {
        "runs": RunOutput(runs, many=True).data,
        "config_diff": run_config_diff(runs=runs),
        "latest": latest_metrics_for_runs(runs=runs, keys=keys),
        **runs_compare(runs=runs, keys=keys, buckets=buckets, x=x, target=target),
    }


def _run_ids(request) -> list[int]:
    """The ``ids`` query parameter of the compare endpoints: 1-20 run ids, a 400 naming it."""
    try:
        ids = [int(x) for x in list_param(request, "ids", max_items=20, max_length=18) or []]
    except ValueError:
        raise ValidationError({"ids": "comma-separated run ids"}) from None
    if not ids:
        raise ValidationError({"ids": "give at least one run id"})
    return ids


class RunCompareApi(APIView):
    renderer_classes = CHART_RENDERERS

    @extend_schema(operation_id="runs_compare", parameters=[
        str_query("ids", "comma-separated run ids, 1-20"), KEYS, BUCKETS, X_AXIS, TARGET],
        responses={200: CompareOutput, **errors(400, 401, 404)})
    def get(self, request):
        ids = _run_ids(request)
        return Response(compare_response(request, runs_get(user=request.user, run_ids=ids)))


# ---- evaluations (issue 48) -------------------------------------------------------------------


class EvalCurveOutput(serializers.Serializer):
    set = serializers.CharField(help_text="the eval set (heldout: the run's own held-out rows)")
    metric = serializers.ChoiceField(choices=list(EVAL_CHART_METRICS))
    key = serializers.CharField(help_text="eval/<set>/<metric>")
    x = serializers.ListField(child=serializers.FloatField())
    step = serializers.ListField(child=serializers.IntegerField())
    value = serializers.ListField(child=serializers.FloatField())
    lo = serializers.ListField(child=serializers.FloatField(allow_null=True),
                               help_text="the 95% interval's low end (null: not logged)")
    hi = serializers.ListField(child=serializers.FloatField(allow_null=True))
    version = serializers.ListField(child=serializers.IntegerField(allow_null=True),
                                    help_text="the weight version evaluated")
    downsampled = serializers.BooleanField()


class RunEvalsApi(APIView):
    """The run page's evaluation panel: each eval set, each metric, with its 95% interval."""

    renderer_classes = CHART_RENDERERS

    class Output(serializers.Serializer):
        run = serializers.IntegerField()
        curves = EvalCurveOutput(many=True, help_text="empty: no evaluation yet")

    @extend_schema(operation_id="runs_evals_retrieve", parameters=[BUCKETS, X_AXIS],
                   responses={200: Output, **errors(400, 401, 404)})
    def get(self, request, run_id: int):
        run = run_get(user=request.user, run_id=run_id)
        buckets, x = _buckets(request), _x(request)
        return Response({"run": run.id, "curves": run_eval_series(run=run, buckets=buckets, x=x)})


class EvalReachOutput(serializers.Serializer):
    run_id = serializers.IntegerField()
    name = serializers.CharField()
    status = serializers.CharField()
    evals = serializers.IntegerField(help_text="evaluations of this set and metric")
    final = serializers.FloatField(allow_null=True, help_text="the last evaluation's value")
    final_step = serializers.IntegerField(allow_null=True)
    final_ci = serializers.ListField(child=serializers.FloatField(allow_null=True),
                                     allow_null=True, help_text="its 95% interval [lo, hi]")
    reached = serializers.BooleanField(help_text="false: the target was never reached")
    minutes_to_target = serializers.FloatField(allow_null=True, help_text=(
        "wall time from the run's first step, interpolated between the two evaluations that "
        "straddle the target"))
    step_to_target = serializers.FloatField(allow_null=True)
    tokens_to_target = serializers.FloatField(allow_null=True)


class EvalCompareOutput(serializers.Serializer):
    set = serializers.CharField()
    metric = serializers.CharField()
    sets = serializers.DictField(child=serializers.ListField(child=serializers.CharField()),
                                 help_text="every eval set the runs have, with its metrics")
    target = serializers.FloatField(allow_null=True, help_text=(
        "default: the lowest final value among the runs"))
    series = serializers.JSONField(help_text="run id -> curve (as in /evals/)")
    rows = EvalReachOutput(many=True)


class RunEvalCompareApi(APIView):
    """Eval accuracy of several runs against step, tokens or wall time, and when each first
    reached a target accuracy."""

    renderer_classes = CHART_RENDERERS

    @extend_schema(operation_id="runs_compare_evals", parameters=[
        str_query("ids", "comma-separated run ids, 1-20"),
        str_query("set", "eval set (default: heldout, else the first the runs have)"),
        str_query("metric", "default greedy_accuracy", list(EVAL_CHART_METRICS)),
        BUCKETS, X_AXIS,
        OpenApiParameter("target", {"type": "number"}, OpenApiParameter.QUERY, required=False,
                         description="accuracy to time (default: the lowest final value)")],
        responses={200: EvalCompareOutput, **errors(400, 401, 404)})
    def get(self, request):
        ids = _run_ids(request)
        set_name = request.query_params.get("set") or None
        if set_name is not None and (len(set_name) > 40 or "/" in set_name):
            raise ValidationError({"set": "an eval set's name: at most 40 characters, no '/'"})
        metric = request.query_params.get("metric") or "greedy_accuracy"
        if metric not in EVAL_CHART_METRICS:
            raise ValidationError({"metric": f"must be one of {', '.join(EVAL_CHART_METRICS)}"})
        runs = runs_get(user=request.user, run_ids=ids)
        return Response(runs_eval_compare(runs=runs, set_name=set_name, metric=metric,
                                          x=_x(request), target=_target(request),
                                          buckets=_buckets(request)))
