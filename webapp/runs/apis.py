from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.core.fields import BoundedText
from webapp.core.params import choice_param, int_param
from webapp.core.schema import PROJECT_FILTER, errors, int_query, str_query
from webapp.accounts.selectors import project_get_for_user
from webapp.datasets.selectors import dataset_version_get
from webapp.rewards.selectors import reward_version_get
from webapp.runs.models import Run
from webapp.runs.selectors import run_event_list, run_get, run_list
from webapp.runs.services import run_cancel, run_create, run_resume, run_token_issue


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
    started_at = serializers.DateTimeField(allow_null=True, help_text="null while queued")
    finished_at = serializers.DateTimeField(allow_null=True, help_text="null until it ends")
    duration_s = serializers.FloatField(allow_null=True, help_text="null until it starts")


class RunSpecOutput(RunOutput):
    """A run with its resolved spec (what creating a run returns; the detail endpoint adds the
    tracker's latest metrics)."""

    spec = serializers.JSONField()


class RunCreatedOutput(RunSpecOutput):
    ingest_token = serializers.CharField(help_text="for a trainer you run yourself: shown once, "
                                                   "void when the run ends")


class RunPageOutput(serializers.Serializer):
    count = serializers.IntegerField()
    next = serializers.URLField(allow_null=True)
    previous = serializers.URLField(allow_null=True)
    results = RunOutput(many=True)


class RunEventOutput(serializers.Serializer):
    id = serializers.IntegerField()
    time = serializers.DateTimeField()
    kind = serializers.CharField()
    message = serializers.CharField(allow_blank=True)
    data = serializers.JSONField()


class RunListApi(APIView):
    @extend_schema(operation_id="runs_list", parameters=[
        PROJECT_FILTER, str_query("status", "only runs in this state", list(Run.Status.values)),
        str_query("search", "name contains"),
        int_query("limit", "page size (default 50, at most 1000)", minimum=1),
        int_query("offset", "first item")],
        responses={200: RunPageOutput, **errors(400, 401)})
    def get(self, request):
        q = request.query_params
        qs = run_list(user=request.user, project_id=int_param(request, "project"),
                      status=choice_param(request, "status", list(Run.Status.values)),
                      search=q.get("search"))
        int_param(request, "offset")  # the paginator ignores bad values: refuse them instead
        if int_param(request, "limit") == 0:
            raise ValidationError({"limit": "must be at least 1"})
        page = LimitOffsetPagination()
        page.max_limit = 1000
        items = page.paginate_queryset(qs, request, view=self)
        return page.get_paginated_response(RunOutput(items, many=True).data)


class RunCreateApi(APIView):
    class InputSerializer(serializers.Serializer):
        project = serializers.IntegerField()
        name = BoundedText(max_length=100)
        dataset_version = serializers.IntegerField()
        reward_version = serializers.IntegerField()
        spec = serializers.DictField(required=False, default=dict)  # a mapping of sections

    @extend_schema(operation_id="runs_create", request=InputSerializer,
                   responses={201: RunCreatedOutput, **errors(400, 401, 403, 404)})
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        project = project_get_for_user(user=request.user, project_id=v["project"])
        run = run_create(project=project, user=request.user, name=v["name"],
                         dataset_version=dataset_version_get(user=request.user, version_id=v["dataset_version"]),
                         reward_version=reward_version_get(user=request.user, version_id=v["reward_version"]),
                         spec=v["spec"])
        out = RunSpecOutput(run).data
        # For a trainer the creator runs: shown once, stored only as a hash, void when the run ends.
        out["ingest_token"] = run_token_issue(run=run, purpose="creator")
        return Response(out, status=201)


class RunCancelApi(APIView):
    @extend_schema(operation_id="runs_cancel", request=None,
                   responses={202: RunOutput, **errors(401, 404, 409)})
    def post(self, request, run_id: int):
        run = run_cancel(run=run_get(user=request.user, run_id=run_id), user=request.user)
        return Response(RunOutput(run).data, status=202)


class RunResumeApi(APIView):
    @extend_schema(operation_id="runs_resume", request=None,
                   responses={202: RunOutput, **errors(401, 404, 409)})
    def post(self, request, run_id: int):
        run = run_resume(run=run_get(user=request.user, run_id=run_id), user=request.user)
        return Response(RunOutput(run).data, status=202)


class RunEventsApi(APIView):
    @extend_schema(operation_id="runs_events_list",
                   parameters=[int_query("after", "only events with a larger id (for polling)")],
                   responses={200: RunEventOutput(many=True), **errors(400, 401, 404)})
    def get(self, request, run_id: int):
        run = run_get(user=request.user, run_id=run_id)
        events = run_event_list(run=run, after=int_param(request, "after") or 0)
        return Response([{"id": e.id, "time": e.time, "kind": e.kind, "message": e.message,
                          "data": e.data} for e in events])
