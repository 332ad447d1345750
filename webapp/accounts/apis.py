from django.contrib.auth import authenticate
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, serializers
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.accounts.selectors import (
    QUOTA_FIELDS,
    project_get_for_user,
    project_list,
    project_quota_limits,
    token_list,
)
from webapp.accounts.services import (
    project_create,
    project_quota_set,
    token_create,
    token_revoke,
)
from webapp.core.fields import BoundedText
from webapp.core.parsers import BoundedJSONParser
from webapp.core.schema import errors
from webapp.core.throttle import login_blocked, login_failed, login_succeeded, retry_after_s


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


MAX_QUOTA = 2**63 - 1


class QuotaOutput(serializers.Serializer):
    max_servers = serializers.IntegerField(help_text="rollout.num_servers")
    max_reward_workers = serializers.IntegerField(help_text="reward.workers")
    max_concurrent = serializers.IntegerField(help_text="rollout.max_concurrent")
    max_new_tokens = serializers.IntegerField(help_text="rollout.max_new_tokens")
    max_steps = serializers.IntegerField(help_text="trainer.steps")
    max_model_params = serializers.IntegerField(help_text="a tiny model's parameters")
    custom = serializers.ListField(child=serializers.CharField(),
                                   help_text="the fields set for this project (others: defaults)")


def _quota_answer(project) -> dict:
    from webapp.accounts.models import ProjectQuota

    quota = ProjectQuota.objects.filter(project=project).first()
    custom = [name for name in QUOTA_FIELDS if quota is not None and getattr(quota, name) is not None]
    return QuotaOutput({**project_quota_limits(project=project), "custom": custom}).data


class ProjectQuotaApi(APIView):
    """A project's maxima for its members' runs: every member reads them; site administrators
    set them (a field set to null goes back to the site default)."""

    class InputSerializer(serializers.Serializer):
        max_servers = serializers.IntegerField(min_value=1, max_value=2**31 - 1, required=False,
                                               allow_null=True)
        max_reward_workers = serializers.IntegerField(min_value=1, max_value=2**31 - 1,
                                                      required=False, allow_null=True)
        max_concurrent = serializers.IntegerField(min_value=1, max_value=2**31 - 1,
                                                  required=False, allow_null=True)
        max_new_tokens = serializers.IntegerField(min_value=1, max_value=2**31 - 1,
                                                  required=False, allow_null=True)
        max_steps = serializers.IntegerField(min_value=1, max_value=MAX_QUOTA, required=False,
                                             allow_null=True)
        max_model_params = serializers.IntegerField(min_value=1, max_value=MAX_QUOTA,
                                                    required=False, allow_null=True)

    @extend_schema(operation_id="projects_quota_retrieve",
                   responses={200: QuotaOutput, **errors(401, 404)})
    def get(self, request, project_id: int):
        return Response(_quota_answer(project_get_for_user(user=request.user,
                                                           project_id=project_id)))

    @extend_schema(operation_id="projects_quota_update", request=InputSerializer,
                   responses={200: QuotaOutput, **errors(400, 401, 403, 404)})
    def put(self, request, project_id: int):
        project = project_get_for_user(user=request.user, project_id=project_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        project_quota_set(user=request.user, project=project, values=data.validated_data)
        return Response(_quota_answer(project))


class TokenOutput(serializers.Serializer):
    token = serializers.CharField(help_text="send as `Authorization: Token <token>`; shown once")
    token_key = serializers.CharField(help_text="the token's first characters: its name in the "
                                                "token list, and what revokes it")
    expiry = serializers.DateTimeField(allow_null=True)


class TokenObtainApi(APIView):
    """Trade a username and password for a new API token (hashed at rest, expires after
    OOLONG_API_TOKEN_TTL_DAYS). Failures are throttled per username and client address."""

    authentication_classes: list = []
    permission_classes = [AllowAny]
    parser_classes = [BoundedJSONParser]

    class InputSerializer(serializers.Serializer):
        username = serializers.CharField(max_length=150)
        password = serializers.CharField(max_length=4096, trim_whitespace=False,
                                         style={"input_type": "password"})

    @extend_schema(request=InputSerializer, responses={200: TokenOutput, **errors(400, 429)},
                   auth=[], operation_id="auth_token_create")
    def post(self, request, *args, **kwargs):
        username = str(request.data.get("username", ""))[:300] if isinstance(request.data, dict) \
            else ""
        if login_blocked(request, username):
            raise exceptions.Throttled(wait=retry_after_s(), detail="too many failed logins for "
                                       "this user from this address")
        data = self.InputSerializer(data=request.data)
        if not data.is_valid():
            login_failed(request, username)
            raise exceptions.ValidationError(data.errors)
        user = authenticate(request._request, username=data.validated_data["username"],
                            password=data.validated_data["password"])
        if user is None or not user.is_active:
            login_failed(request, username)
            raise exceptions.ValidationError(
                {"password": "unable to log in with this username and password"})
        login_succeeded(request, username)
        token, instance = token_create(user=user)
        return Response(TokenOutput({"token": token, "token_key": instance.token_key,
                                     "expiry": instance.expiry}).data)


class TokenItemOutput(serializers.Serializer):
    token_key = serializers.CharField()
    created = serializers.DateTimeField()
    expiry = serializers.DateTimeField(allow_null=True)
    current = serializers.BooleanField(help_text="the token this request came with")


class TokenListApi(APIView):
    """Your live API tokens (never the tokens themselves: their first characters)."""

    @extend_schema(operation_id="auth_tokens_list", responses={200: TokenItemOutput(many=True),
                                                               **errors(401)})
    def get(self, request):
        current = getattr(request.auth, "digest", None)
        return Response(TokenItemOutput([
            {"token_key": t.token_key, "created": t.created, "expiry": t.expiry,
             "current": t.digest == current} for t in token_list(user=request.user)[:100]],
            many=True).data)


class TokenRevokeApi(APIView):
    """Revoke one of your API tokens by its key (from the list); the token in use may be
    revoked too (a logout)."""

    @extend_schema(operation_id="auth_tokens_destroy", request=None,
                   responses={204: None, **errors(401, 404)})
    def delete(self, request, token_key: str):
        token_revoke(user=request.user, token_key=token_key)
        return Response(status=204)
