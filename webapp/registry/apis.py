from pathlib import Path

from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.core.errors import ApplicationError
from webapp.core.fields import BoundedText
from webapp.core.params import choice_param, int_param, paginated
from webapp.core.schema import PROJECT_FILTER, errors, int_query, str_query
from webapp.registry.archive import tar_stream
from webapp.registry.models import ModelVersion
from webapp.registry.selectors import model_alias_list, model_version_get, model_version_list
from webapp.registry.services import model_alias_delete, model_alias_set, model_version_request
from webapp.runs.selectors import run_get


class ModelVersionOutput(serializers.Serializer):
    id = serializers.IntegerField()
    project_id = serializers.IntegerField()
    name = serializers.CharField()
    run_id = serializers.IntegerField()
    requested = serializers.CharField(help_text="what was asked: a version, latest or best")
    version = serializers.IntegerField(allow_null=True, help_text="null until exported")
    step = serializers.IntegerField(allow_null=True)
    dataset_version_id = serializers.IntegerField()
    reward_version_id = serializers.IntegerField()
    evaluation = serializers.JSONField(help_text="held-out metrics recorded at this version")
    source = serializers.CharField(help_text="pushed | checkpoint | initial")
    size_bytes = serializers.IntegerField()
    status = serializers.CharField()
    error = serializers.CharField(allow_blank=True)
    aliases = serializers.SerializerMethodField()
    created_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)

    def get_aliases(self, mv) -> list[str]:
        return model_alias_list(model_version=mv)


class ModelVersionDetailOutput(ModelVersionOutput):
    lineage = serializers.JSONField(help_text="the export's oolong.json: run, step, base model, "
                                              "dataset, reward, code version, the resolved spec")


class ModelVersionPageOutput(serializers.Serializer):
    count = serializers.IntegerField()
    next = serializers.URLField(allow_null=True)
    previous = serializers.URLField(allow_null=True)
    results = ModelVersionOutput(many=True)


class ModelListApi(APIView):
    @extend_schema(operation_id="models_list", parameters=[
        PROJECT_FILTER, int_query("run", "only this run's exports"),
        str_query("name", "only this registered model"), str_query("alias", "the version this alias names"),
        str_query("status", "only in this state", list(ModelVersion.Status.values)),
        int_query("limit", "page size (default 50, at most 1000)", minimum=1),
        int_query("offset", "first item")],
        responses={200: ModelVersionPageOutput, **errors(400, 401)})
    def get(self, request):
        q = request.query_params
        qs = model_version_list(user=request.user, project_id=int_param(request, "project"),
                                run_id=int_param(request, "run"), name=q.get("name"),
                                alias=q.get("alias"),
                                status=choice_param(request, "status", list(ModelVersion.Status.values)))
        return paginated(request, self, qs, ModelVersionOutput, max_limit=1000)


class RunExportApi(APIView):
    class InputSerializer(serializers.Serializer):
        version = BoundedText(max_length=20, default="latest",
                              help_text="a policy version number, 'latest' or 'best'")
        name = BoundedText(max_length=100, required=False, default="", allow_blank=True,
                           help_text="the registered model's name (default: the run's)")

    @extend_schema(operation_id="runs_export", request=InputSerializer,
                   responses={202: ModelVersionOutput, **errors(400, 401, 404, 409)})
    def post(self, request, run_id: int):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        mv = model_version_request(run=run_get(user=request.user, run_id=run_id), user=request.user,
                                   **data.validated_data)
        return Response(ModelVersionOutput(mv).data, status=202)


class ModelDetailApi(APIView):
    @extend_schema(operation_id="models_retrieve", responses={200: ModelVersionDetailOutput,
                                                              **errors(401, 404)})
    def get(self, request, model_id: int):
        mv = model_version_get(user=request.user, model_version_id=model_id)
        return Response(ModelVersionDetailOutput(mv).data)


class ModelDownloadApi(APIView):
    @extend_schema(operation_id="models_download", responses={
        (200, "application/x-tar"): OpenApiResponse(OpenApiTypes.BINARY, description=(
            "the exported folder as a tar archive, streamed")), **errors(401, 404, 409)})
    def get(self, request, model_id: int):
        mv = model_version_get(user=request.user, model_version_id=model_id)
        if mv.status != ModelVersion.Status.READY:
            raise ApplicationError(f"model version {mv.id} is {mv.status}: nothing to download",
                                   field="model", status_code=409)
        folder = Path(mv.path)
        if not folder.is_dir():
            raise ApplicationError(f"model version {mv.id}: its folder is gone from the store",
                                   field="model", status_code=409)
        stem = f"{mv.name}-v{mv.version}"
        response = StreamingHttpResponse(tar_stream(folder, stem), content_type="application/x-tar")
        response["Content-Disposition"] = f'attachment; filename="{stem}.tar"'
        return response


class ModelAliasesApi(APIView):
    class InputSerializer(serializers.Serializer):
        alias = BoundedText(max_length=50, help_text="e.g. production; moved here if it is "
                                                     "elsewhere in the project")

    @extend_schema(operation_id="models_alias_set", request=InputSerializer,
                   responses={200: ModelVersionOutput, **errors(400, 401, 404, 409)})
    def post(self, request, model_id: int):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        mv = model_version_get(user=request.user, model_version_id=model_id)
        model_alias_set(model_version=mv, alias=data.validated_data["alias"], user=request.user)
        return Response(ModelVersionOutput(model_version_get(user=request.user,
                                                             model_version_id=mv.id)).data)


class ModelAliasDeleteApi(APIView):
    @extend_schema(operation_id="models_alias_delete", request=None,
                   responses={204: None, **errors(401, 404)})
    def delete(self, request, model_id: int, alias: str):
        mv = model_version_get(user=request.user, model_version_id=model_id)
        model_alias_delete(model_version=mv, alias=alias)
        return Response(status=204)
