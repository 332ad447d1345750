from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.accounts.selectors import project_get_for_user
from webapp.core.fields import BoundedText
from webapp.core.params import int_param, paginated
from webapp.core.schema import PROJECT_FILTER, errors, int_query
from webapp.datasets.selectors import dataset_version_get, dataset_versions_get
from webapp.rewards.selectors import reward_version_get
from webapp.runs.apis import RunOutput
from webapp.runs.models import MAX_EVAL_SETS
from webapp.runs.selectors import run_get
from webapp.sweeps.selectors import sweep_get, sweep_list, sweep_runs
from webapp.sweeps.services import (
    MAX_AXES,
    MAX_RUNS,
    MAX_VALUES,
    sweep_create,
    sweep_create_from_run,
)
from webapp.tracking.apis import BUCKETS, KEYS, TARGET, X_AXIS, CompareOutput, compare_response


class AxisSerializer(serializers.Serializer):
    field = serializers.CharField(max_length=100, help_text="dotted spec key, e.g. rollout.max_staleness")
    values = serializers.ListField(child=serializers.JSONField(), min_length=1,
                                   max_length=MAX_VALUES, help_text="numbers, text, true/false")


AXES = serializers.ListField(child=AxisSerializer(), min_length=1, max_length=MAX_AXES,
                             help_text=f"one or two fields; at most {MAX_RUNS} combinations")


class SweepRunOutput(RunOutput):
    sweep_values = serializers.DictField(help_text="this run's values of the sweep's axes")


class SweepOutput(serializers.Serializer):
    id = serializers.IntegerField()
    project_id = serializers.IntegerField()
    name = serializers.CharField()
    axes = AxisSerializer(many=True)
    base_spec = serializers.DictField()
    share_warm_start = serializers.BooleanField()
    created_at = serializers.DateTimeField()


class SweepDetailOutput(SweepOutput):
    runs = SweepRunOutput(many=True)


def _detail(sweep) -> dict:
    return {**SweepOutput(sweep).data,
            "runs": SweepRunOutput(sweep_runs(sweep=sweep), many=True).data}


class SweepCreateApi(APIView):
    """Create a sweep: one run per combination of the axes' values, queued together."""

    class InputSerializer(serializers.Serializer):
        project = serializers.IntegerField()
        name = BoundedText(max_length=80)
        dataset_version = serializers.IntegerField()
        reward_version = serializers.IntegerField()
        spec = serializers.DictField(required=False, default=dict, help_text="the shared spec")
        axes = AXES
        share_warm_start = serializers.BooleanField(default=True)
        eval_set_versions = serializers.ListField(
            child=serializers.IntegerField(min_value=1, max_value=2**63 - 1), required=False,
            default=list,
            max_length=MAX_EVAL_SETS, help_text="eval-set dataset versions, attached to each run")

    @extend_schema(operation_id="sweeps_create", request=InputSerializer,
                   responses={201: SweepDetailOutput, **errors(400, 401, 403, 404)})
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        sweep = sweep_create(
            project=project_get_for_user(user=request.user, project_id=v["project"]),
            user=request.user, name=v["name"],
            dataset_version=dataset_version_get(user=request.user, version_id=v["dataset_version"]),
            reward_version=reward_version_get(user=request.user, version_id=v["reward_version"]),
            spec=v["spec"], axes=[dict(a) for a in v["axes"]],
            share_warm_start=v["share_warm_start"],
            eval_set_versions=dataset_versions_get(user=request.user,
                                                   version_ids=v["eval_set_versions"]))
        return Response(_detail(sweep), status=201)


class SweepFromRunCreateApi(APIView):
    """A sweep of fresh runs around a run's configuration (its dataset, reward and spec), e.g.
    ``rollout.max_staleness`` = [2, 0] to compare it with synchronous RL."""

    class InputSerializer(serializers.Serializer):
        axes = AXES
        name = BoundedText(max_length=80, required=False)

    @extend_schema(operation_id="runs_sweep_create", request=InputSerializer,
                   responses={201: SweepDetailOutput, **errors(400, 401, 403, 404)})
    def post(self, request, run_id: int):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        sweep = sweep_create_from_run(run=run_get(user=request.user, run_id=run_id),
                                      user=request.user, axes=[dict(a) for a in v["axes"]],
                                      name=v.get("name"))
        return Response(_detail(sweep), status=201)


class SweepListApi(APIView):
    class PageOutput(serializers.Serializer):
        count = serializers.IntegerField()
        next = serializers.URLField(allow_null=True)
        previous = serializers.URLField(allow_null=True)
        results = SweepOutput(many=True)

    @extend_schema(operation_id="sweeps_list", parameters=[
        PROJECT_FILTER, int_query("limit", "page size (default 50, at most 200)", minimum=1),
        int_query("offset", "first item")], responses={200: PageOutput, **errors(400, 401)})
    def get(self, request):
        qs = sweep_list(user=request.user, project_id=int_param(request, "project"))
        return paginated(request, self, qs, SweepOutput, max_limit=200)


class SweepDetailApi(APIView):
    @extend_schema(operation_id="sweeps_retrieve", responses={200: SweepDetailOutput, **errors(401, 404)})
    def get(self, request, sweep_id: int):
        return Response(_detail(sweep_get(user=request.user, sweep_id=sweep_id)))


class SweepCompareApi(APIView):
    """The sweep's runs compared: overlaid series, the config diff (the axes, and nothing else
    when the runs share everything else), the summary (final and best eval, time to a target
    reward, tokens/s)."""

    class Output(CompareOutput):
        sweep = SweepOutput()

    @extend_schema(operation_id="sweeps_compare", parameters=[KEYS, BUCKETS, X_AXIS, TARGET],
                   responses={200: Output, **errors(400, 401, 404)})
    def get(self, request, sweep_id: int):
        sweep = sweep_get(user=request.user, sweep_id=sweep_id)
        runs = sweep_runs(sweep=sweep)
        return Response({"sweep": SweepOutput(sweep).data, **compare_response(request, runs)})
