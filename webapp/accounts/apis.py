from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, serializers
from rest_framework.authtoken.views import ObtainAuthToken
from rest_framework.parsers import JSONParser
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.accounts.selectors import project_list
from webapp.accounts.services import project_create
from webapp.core.fields import BoundedText
from webapp.core.schema import errors
from webapp.core.throttle import login_blocked, login_failed, retry_after_s


class ProjectOutput(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    slug = serializers.CharField()
    created_at = serializers.DateTimeField()


class ProjectListApi(APIView):
    @extend_schema(operation_id="projects_list", responses={200: ProjectOutput(many=True),
                                                             **errors(401)})
    def get(self, request):
        return Response(ProjectOutput(project_list(user=request.user), many=True).data)


class ProjectCreateApi(APIView):
    class InputSerializer(serializers.Serializer):
        name = BoundedText(max_length=100)
        slug = serializers.SlugField(max_length=100, required=False)

    @extend_schema(operation_id="projects_create", request=InputSerializer,
                   responses={201: ProjectOutput, **errors(400, 401, 409)})
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        project = project_create(user=request.user, **data.validated_data)
        return Response(ProjectOutput(project).data, status=201)


class TokenOutput(serializers.Serializer):
    token = serializers.CharField()


class TokenObtainApi(ObtainAuthToken):
    """Trade a username and password for the user's API token."""

    parser_classes = [JSONParser]

    @extend_schema(request=ObtainAuthToken.serializer_class,
                   responses={200: TokenOutput, **errors(400, 429)}, auth=[],
                   operation_id="auth_token_create")
    def post(self, request, *args, **kwargs):
        if login_blocked(request):
            raise exceptions.Throttled(wait=retry_after_s(),
                                       detail="too many failed logins from this address")
        try:
            return super().post(request, *args, **kwargs)
        except exceptions.ValidationError:
            login_failed(request)
            raise
