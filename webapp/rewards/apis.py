from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.accounts.selectors import project_get_for_user
from webapp.core.fields import BoundedText
from webapp.core.params import int_param
from webapp.core.schema import PROJECT_FILTER, errors
from webapp.rewards.selectors import reward_function_get, reward_function_list
from webapp.rewards.services import reward_function_create


class RewardVersionOutput(serializers.Serializer):
    id = serializers.IntegerField()
    version = serializers.IntegerField()
    builtin_name = serializers.CharField()
    entrypoint = serializers.CharField()
    status = serializers.CharField()
    validation_report = serializers.JSONField()
    fn_path = serializers.CharField()
    created_at = serializers.DateTimeField()


class RewardOutput(serializers.Serializer):
    id = serializers.IntegerField()
    project_id = serializers.IntegerField()
    name = serializers.CharField()
    kind = serializers.CharField()
    description = serializers.CharField()
    versions = RewardVersionOutput(many=True, source="versions.all")


class RewardListApi(APIView):
    @extend_schema(operation_id="rewards_list", parameters=[PROJECT_FILTER],
                   responses={200: RewardOutput(many=True), **errors(400, 401)})
    def get(self, request):
        qs = reward_function_list(user=request.user, project_id=int_param(request, "project"))
        return Response(RewardOutput(qs, many=True).data)


class RewardCreateApi(APIView):
    """A built-in (``builtin``) or user code (``source`` + ``entrypoint``), validated by a worker."""

    class InputSerializer(serializers.Serializer):
        project = serializers.IntegerField()
        name = BoundedText(max_length=100)
        builtin = serializers.CharField(required=False, allow_blank=True)
        source = serializers.CharField(required=False, allow_blank=True, trim_whitespace=False)
        entrypoint = serializers.CharField(required=False, default="reward")
        description = serializers.CharField(required=False, allow_blank=True, default="")

    @extend_schema(operation_id="rewards_create", request=InputSerializer,
                   responses={201: RewardVersionOutput, **errors(400, 401, 404)})
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        project = project_get_for_user(user=request.user, project_id=v.pop("project"))
        version = reward_function_create(project=project, user=request.user, name=v["name"],
                                         builtin=v.get("builtin") or None,
                                         source=v.get("source") or None,
                                         entrypoint=v["entrypoint"], description=v["description"])
        return Response(RewardVersionOutput(version).data, status=201)


class RewardDetailApi(APIView):
    @extend_schema(operation_id="rewards_retrieve", responses={200: RewardOutput, **errors(401, 404)})
    def get(self, request, reward_id: int):
        return Response(RewardOutput(reward_function_get(user=request.user, reward_id=reward_id)).data)
