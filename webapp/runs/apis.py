from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.accounts.selectors import project_get_for_user
from webapp.core.fields import BoundedText
from webapp.core.params import choice_param, int_param, paginated
from webapp.core.schema import PROJECT_FILTER, ErrorItem, errors, int_query, str_query
from webapp.datasets.selectors import dataset_version_get, dataset_versions_get
from webapp.rewards.selectors import reward_version_get
from webapp.runs.models import MAX_EVAL_SETS, Run
from webapp.runs.selectors import run_event_list, run_get, run_list, run_spec_fields
from webapp.runs.services import (
    run_cancel,
    run_create,
    run_resume,
    run_spec_check,
    run_token_issue,
)


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


class RunEvalSetOutput(serializers.Serializer):
    name = serializers.CharField(help_text="its metrics are eval/<name>/...")
    dataset_version_id = serializers.IntegerField()


class RunSpecOutput(RunOutput):
    """A run with its resolved spec (what creating a run returns; the detail endpoint adds the
    tracker's latest metrics)."""

    spec = serializers.JSONField()
    eval_sets = RunEvalSetOutput(many=True, source="eval_sets.all", help_text=(
        "the eval-set dataset versions attached to the run"))


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


class NotQueuedOutput(serializers.Serializer):
    message = serializers.CharField()
    errors = ErrorItem(many=True)
    run_id = serializers.IntegerField(help_text="the run, created and kept: it is submitted when "
                                                "the task queue is back")


def _not_queued(run: Run) -> dict:
    message = (f"run {run.id} was created but could not be queued: {run.submit_error}; it is "
               "kept and will be submitted once the task queue is reachable again")
    return {"message": message, "errors": [{"field": None, "message": message}],
            "run_id": run.id}

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
        return paginated(request, self, qs, RunOutput, max_limit=1000)


class RunCreateApi(APIView):
    class InputSerializer(serializers.Serializer):
        project = serializers.IntegerField()
        name = BoundedText(max_length=100)
        dataset_version = serializers.IntegerField()
        reward_version = serializers.IntegerField()
        spec = serializers.DictField(required=False, default=dict)  # a mapping of sections
        eval_set_versions = serializers.ListField(
            child=serializers.IntegerField(min_value=1, max_value=2**63 - 1), required=False,
            default=list,
            max_length=MAX_EVAL_SETS, help_text=(
                "dataset versions of the project marked as eval sets: each is evaluated "
                "beside the run's held-out rows and its questions are kept out of training"))

    @extend_schema(operation_id="runs_create", request=InputSerializer,
                   responses={201: RunCreatedOutput, 503: NotQueuedOutput,
                              **errors(400, 401, 403, 404)})
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        project = project_get_for_user(user=request.user, project_id=v["project"])
        run = run_create(project=project, user=request.user, name=v["name"],
                         dataset_version=dataset_version_get(user=request.user, version_id=v["dataset_version"]),
                         reward_version=reward_version_get(user=request.user, version_id=v["reward_version"]),
                         spec=v["spec"],
                         eval_set_versions=dataset_versions_get(
                             user=request.user, version_ids=v["eval_set_versions"]))
        if run.submit_error:  # created, but not queued: the outbox sends it again (reconcile)
            return Response(_not_queued(run), status=503)
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
                   responses={202: RunOutput, 503: NotQueuedOutput, **errors(401, 404, 409)})
    def post(self, request, run_id: int):
        run = run_resume(run=run_get(user=request.user, run_id=run_id), user=request.user)
        if run.submit_error:
            return Response(_not_queued(run), status=503)
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


class SpecFieldOutput(serializers.Serializer):
    path = serializers.CharField(help_text="dotted key, e.g. rollout.max_staleness")
    section = serializers.CharField()
    section_title = serializers.CharField()
    name = serializers.CharField()
    label = serializers.CharField()
    kind = serializers.ChoiceField(choices=["integer", "number", "boolean", "string", "choice",
                                            "list", "mapping"])
    default = serializers.JSONField(allow_null=True)
    nullable = serializers.BooleanField(help_text="may be left empty (null)")
    description = serializers.CharField(allow_blank=True)
    choices = serializers.ListField(child=serializers.JSONField(), required=False)
    item_kind = serializers.CharField(required=False, help_text="list fields: the items' kind")
    minimum = serializers.FloatField(required=False)
    maximum = serializers.FloatField(required=False)
    exclusiveMinimum = serializers.FloatField(required=False)  # noqa: N815 - JSON schema's name
    exclusiveMaximum = serializers.FloatField(required=False)  # noqa: N815 - JSON schema's name
    pattern = serializers.CharField(required=False)
    common = serializers.BooleanField(help_text="shown up front in the run form")
    admin = serializers.BooleanField(help_text="administrators only (others do not get it)")
    sweepable = serializers.BooleanField(help_text="a sweep may vary it")


class RunSpecSchemaApi(APIView):
    """The run spec's fields as the run form shows them to this user, and its JSON schema."""

    class Output(serializers.Serializer):
        fields = SpecFieldOutput(many=True)
        json_schema = serializers.JSONField(help_text="RunSpec's JSON schema (pydantic)")

    @extend_schema(operation_id="runs_spec_schema", responses={200: Output, **errors(401)})
    def get(self, request):
        from training_core.spec_fields import spec_json_schema

        return Response({"fields": run_spec_fields(user=request.user),
                         "json_schema": spec_json_schema()})


class RunSpecCheckApi(APIView):
    """Check a spec as the run form does while the user types: per-field errors, with the same
    messages as creating a run, and the spec as YAML (or the YAML as a mapping). Creates
    nothing. A spec with errors is a 200 with ``valid: false``: the verdict is the answer."""

    class InputSerializer(serializers.Serializer):
        spec = serializers.DictField(required=False, help_text="a mapping of sections")
        yaml = serializers.CharField(required=False, allow_blank=True, trim_whitespace=False,
                                     max_length=100_000, help_text="or the spec as YAML text")

        def validate(self, attrs):
            if ("spec" in attrs) == ("yaml" in attrs):
                raise ValidationError({"spec": "give either spec (a mapping) or yaml (text)"})
            return attrs

    class Output(serializers.Serializer):
        valid = serializers.BooleanField()
        errors = ErrorItem(many=True)
        spec = serializers.DictField(allow_null=True, help_text="the mapping (null: YAML error)")
        yaml = serializers.CharField(allow_blank=True)
        resolved = serializers.DictField(allow_null=True, help_text="the full spec when valid")

    @extend_schema(operation_id="runs_spec_check", request=InputSerializer,
                   responses={200: Output, **errors(400, 401)})
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        return Response(run_spec_check(user=request.user, spec=v.get("spec"), text=v.get("yaml")))
