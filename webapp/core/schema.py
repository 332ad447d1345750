"""OpenAPI building blocks shared by every app's API: the error body and the status codes.

Every operation declares its request, its query parameters and each status code it can answer
with, so a generated client works and schemathesis can check the server against the schema it
serves (tests/security/test_api_fuzz.py)."""

from __future__ import annotations

from drf_spectacular import openapi
from drf_spectacular.utils import OpenApiParameter
from rest_framework import serializers


class ErrorItem(serializers.Serializer):
    field = serializers.CharField(allow_null=True, help_text="the bad field's path, e.g. spec.trainer.lr")
    message = serializers.CharField()
    line = serializers.IntegerField(required=False, allow_null=True,
                                    help_text="dataset uploads: the file's line or row")
    maximum = serializers.IntegerField(required=False, help_text="quotas: the project's maximum")


class ErrorOutput(serializers.Serializer):
    message = serializers.CharField()
    errors = ErrorItem(many=True)


WHY = {400: "invalid input: `errors` names each bad field",
       401: "no or an invalid credential",
       403: "not allowed (e.g. infrastructure fields for non-admins)",
       404: "no such object, or not in one of your projects",
       409: "the object is in a state that does not allow this",
       413: "the body is over its size limit",
       415: "the body is not in a content type the operation takes",
       429: "too many requests (failed logins; a run token past its ingest rate): see "
            "Retry-After"}


def errors(*codes: int) -> dict:
    """``responses`` entries for the error codes an operation can answer with."""
    from drf_spectacular.utils import OpenApiResponse

    return {code: OpenApiResponse(ErrorOutput, description=WHY[code]) for code in codes}


def int_query(name: str, description: str, minimum: int = 0,
              maximum: int = 2**63 - 1) -> OpenApiParameter:
    return OpenApiParameter(name, {"type": "integer", "minimum": minimum, "maximum": maximum},
                            OpenApiParameter.QUERY, required=False, description=description)


def str_query(name: str, description: str, enum: list[str] | None = None) -> OpenApiParameter:
    return OpenApiParameter(name, str, OpenApiParameter.QUERY, required=False,
                            description=description, enum=enum)


PROJECT_FILTER = int_query("project", "only this project's objects")


class AutoSchema(openapi.AutoSchema):
    """Serializers nested in an API class (``RunCreateApi.InputSerializer``) are named after
    it, so components never collide."""

    def get_serializer_name(self, serializer: serializers.Serializer, direction: str) -> str:
        name = type(serializer).__qualname__.replace(".", "")
        return name.replace("InputSerializer", "Input").replace("Api", "")


def document_body_errors(result: dict, generator, request, public) -> dict:
    """Postprocessing hook: any operation with a body can answer 413 (over the size limit) and
    415 (a content type it does not take)."""
    ref = {"$ref": "#/components/schemas/ErrorOutput"}
    for item in result["paths"].values():
        for op in item.values():
            if "requestBody" in op:
                for code in (413, 415):
                    op["responses"].setdefault(str(code), {
                        "content": {"application/json": {"schema": ref}}, "description": WHY[code]})
    return result
