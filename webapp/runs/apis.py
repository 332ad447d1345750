from rest_framework import serializers
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.core.params import int_param

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
    started_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField()
    duration_s = serializers.FloatField()


class RunSpecOutput(RunOutput):
    """A run with its resolved spec (what creating a run returns; the detail endpoint adds the
    tracker's latest metrics)."""

    spec = serializers.JSONField()


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
        spec = serializers.DictField(required=False, default=dict)  # a mapping of sections

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
    def post(self, request, run_id: int):
        run = run_cancel(run=run_get(user=request.user, run_id=run_id), user=request.user)
        return Response(RunOutput(run).data, status=202)


class RunResumeApi(APIView):
    def post(self, request, run_id: int):
        run = run_resume(run=run_get(user=request.user, run_id=run_id), user=request.user)
        return Response(RunOutput(run).data, status=202)


class RunEventsApi(APIView):
    def get(self, request, run_id: int):
        run = run_get(user=request.user, run_id=run_id)
        events = run_event_list(run=run, after=int_param(request, "after") or 0)
        return Response([{"id": e.id, "time": e.time, "kind": e.kind, "message": e.message,
                          "data": e.data} for e in events])
