from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.parsers import MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.accounts.selectors import project_get_for_user
from webapp.core.fields import BoundedText
from webapp.core.params import int_param
from webapp.core.schema import PROJECT_FILTER, errors
from webapp.core.uploads import upload_check
from webapp.datasets.builtins import BUILTINS
from webapp.datasets.models import Dataset
from webapp.datasets.selectors import dataset_get, dataset_list, dataset_version_get
from webapp.datasets.services import (
    dataset_create_builtin,
    dataset_upload,
    dataset_version_eval_set_mark,
)


class DatasetVersionOutput(serializers.Serializer):
    id = serializers.IntegerField()
    version = serializers.IntegerField()
    source = serializers.CharField()
    file_format = serializers.CharField()
    checksum = serializers.CharField()
    row_count = serializers.IntegerField()
    stats = serializers.JSONField()
    is_eval_set = serializers.BooleanField(help_text=(
        "an eval set: runs of the project may attach it (eval_set_versions)"))
    created_at = serializers.DateTimeField()


class DatasetVersionDetailOutput(DatasetVersionOutput):
    dataset_id = serializers.IntegerField()
    preview = serializers.JSONField()


class DatasetOutput(serializers.Serializer):
    id = serializers.IntegerField()
    project_id = serializers.IntegerField()
    name = serializers.CharField()
    task = serializers.CharField()
    description = serializers.CharField()
    versions = DatasetVersionOutput(many=True, source="versions.all")


class DatasetListApi(APIView):
    @extend_schema(operation_id="datasets_list", parameters=[PROJECT_FILTER],
                   responses={200: DatasetOutput(many=True), **errors(400, 401)})
    def get(self, request):
        qs = dataset_list(user=request.user, project_id=int_param(request, "project"))
        return Response(DatasetOutput(qs.prefetch_related("versions"), many=True).data)


class DatasetUploadApi(APIView):
    """Upload JSONL, Parquet or CSV; a second upload with the same name adds a version."""

    parser_classes = [MultiPartParser]

    class InputSerializer(serializers.Serializer):
        project = serializers.IntegerField()
        name = BoundedText(max_length=100)
        task = serializers.ChoiceField(choices=Dataset.Task.values)
        file = serializers.FileField()
        file_format = serializers.ChoiceField(choices=["jsonl", "parquet", "csv"], required=False)
        description = serializers.CharField(required=False, allow_blank=True, default="")
        is_eval_set = serializers.BooleanField(required=False, default=False, help_text=(
            "mark the version as an eval set (runs attach it as eval_set_versions)"))

    @extend_schema(operation_id="datasets_upload", request={"multipart/form-data": InputSerializer},
                   responses={201: DatasetVersionDetailOutput, **errors(400, 401, 404, 413)})
    def post(self, request):
        request.data  # noqa: B018  (parse first: the size cap is enforced while parsing)
        upload_check(request)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        project = project_get_for_user(user=request.user, project_id=v["project"])
        upload = v["file"]
        version = dataset_upload(project=project, user=request.user, name=v["name"], task=v["task"],
                                 filename=upload.name, data=upload.read(),
                                 file_format=v.get("file_format"), description=v["description"],
                                 is_eval_set=v["is_eval_set"])
        return Response(DatasetVersionDetailOutput(version).data, status=201)


class DatasetBuiltinCreateApi(APIView):

    class InputSerializer(serializers.Serializer):
        project = serializers.IntegerField()
        name = BoundedText(max_length=100)
        builtin = serializers.ChoiceField(choices=sorted(BUILTINS))
        size = serializers.IntegerField(min_value=10, max_value=100_000, default=2000)
        seed = serializers.IntegerField(default=0)

    @extend_schema(operation_id="datasets_builtin_create", request=InputSerializer,
                   responses={201: DatasetVersionDetailOutput, **errors(400, 401, 404)})
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        project = project_get_for_user(user=request.user, project_id=v.pop("project"))
        version = dataset_create_builtin(project=project, user=request.user, **v)
        return Response(DatasetVersionDetailOutput(version).data, status=201)


class DatasetDetailApi(APIView):
    @extend_schema(operation_id="datasets_retrieve", responses={200: DatasetOutput, **errors(401, 404)})
    def get(self, request, dataset_id: int):
        return Response(DatasetOutput(dataset_get(user=request.user, dataset_id=dataset_id)).data)


class DatasetVersionDetailApi(APIView):
    class UpdateInput(serializers.Serializer):
        is_eval_set = serializers.BooleanField(help_text=(
            "true: runs of the project may attach this version as an eval set"))

    @extend_schema(operation_id="dataset_versions_retrieve",
                   responses={200: DatasetVersionDetailOutput, **errors(401, 404)})
    def get(self, request, version_id: int):
        version = dataset_version_get(user=request.user, version_id=version_id)
        return Response(DatasetVersionDetailOutput(version).data)

    @extend_schema(operation_id="dataset_versions_update", request=UpdateInput,
                   responses={200: DatasetVersionDetailOutput, **errors(400, 401, 404)})
    def patch(self, request, version_id: int):
        """Mark a version as an eval set, or unmark it (members of its project)."""
        data = self.UpdateInput(data=request.data)
        data.is_valid(raise_exception=True)
        version = dataset_version_eval_set_mark(
            version=dataset_version_get(user=request.user, version_id=version_id),
            is_eval_set=data.validated_data["is_eval_set"])
        return Response(DatasetVersionDetailOutput(version).data)
