"""Errors as JSON with the field and the reason: {"errors": [{"field": ..., "message": ...}]}.

Services raise :class:`webapp.core.errors.ApplicationError`; this handler renders it."""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied, RequestDataTooBig, SuspiciousOperation
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import DataError
from django.http import Http404
from django.views.decorators.csrf import csrf_exempt
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from webapp.core.errors import ApplicationError

logger = logging.getLogger(__name__)


def _flatten(detail: Any, prefix: str = "") -> list[dict[str, Any]]:
    if isinstance(detail, dict):
        out = []
        for key, value in detail.items():
            # List items as events[0].message, the same paths the services name.
            name = (f"{prefix}[{key}]" if isinstance(key, int) else
                    key if not prefix else f"{prefix}.{key}")
            out += _flatten(value, "" if key == "non_field_errors" else name)
        return out
    if isinstance(detail, list):
        out = []
        for item in detail:
            out += _flatten(item, prefix)
        return out
    return [{"field": prefix or None, "message": str(detail)}]


def exception_handler(exc: Exception, context: dict) -> Response | None:
    if isinstance(exc, ApplicationError):
        return Response({"message": exc.message, "errors": exc.errors}, status=exc.status_code)
    if isinstance(exc, DjangoValidationError):
        exc = exceptions.ValidationError(getattr(exc, "message_dict", None) or exc.messages)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound(str(exc) or "not found")
    if isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    if isinstance(exc, RequestDataTooBig):
        return Response({"message": f"the request body is over the limit of "
                                    f"{settings.DATA_UPLOAD_MAX_MEMORY_SIZE / 1e6:.1f} MB",
                         "errors": [{"field": None, "message": "request body too large"}]},
                        status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
    if isinstance(exc, DataError):  # a value the database cannot hold that no check caught
        logger.warning("database refused a value: %s", exc)
        return Response({"message": "a value is out of range or holds characters the database "
                                    "cannot store", "errors": [{"field": None,
                                                                "message": "invalid value"}]},
                        status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, SuspiciousOperation):  # too many fields, bad multipart, ...: the client's
        exc = exceptions.ParseError(str(exc) or "malformed request")
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    errors = _flatten(response.data)
    message = errors[0]["message"] if errors else "error"
    response.data = {"message": message, "errors": errors}
    if response.status_code == status.HTTP_400_BAD_REQUEST:
        response.data["message"] = "invalid input: " + "; ".join(
            f"{e['field']}: {e['message']}" if e["field"] else e["message"] for e in errors[:5])
    return response


def not_found(request, exception=None):
    """Django's 404 (a URL no view matches, e.g. /api/runs/abc/): JSON under /api/, like every
    other API error; the usual page elsewhere."""
    from django.http import JsonResponse
    from django.views.defaults import page_not_found

    if request.path.startswith("/api/"):
        return JsonResponse({"message": "not found", "errors": [
            {"field": None, "message": f"no API endpoint at {request.path[:200]}"}]}, status=404)
    return page_not_found(request, exception)


@csrf_exempt  # it changes nothing; a POST to no endpoint is a 404, not a CSRF 403
def api_not_found(request, rest: str = ""):
    """The last pattern under /api/: a JSON 404 in every setting (under DEBUG, Django answers an
    unmatched URL with its HTML debug page before any handler404 runs), and for a URL that lacks
    its final slash the URL that exists (a POST cannot follow APPEND_SLASH's redirect)."""
    from django.http import JsonResponse
    from django.urls import Resolver404, resolve

    message = f"no API endpoint at {request.path[:200]}"
    if not request.path.endswith("/"):
        try:
            resolved = resolve(request.path + "/")
        except Resolver404:
            resolved = None
        if resolved is not None and resolved.func is not api_not_found:
            message += f"; did you mean {request.path[:200]}/ (with the final slash)?"
    return JsonResponse({"message": "not found", "errors": [{"field": None, "message": message}]},
                        status=404)


def server_error(request):
    from django.http import JsonResponse
    from django.views.defaults import server_error as page

    if request.path.startswith("/api/"):
        return JsonResponse({"message": "internal error", "errors": [
            {"field": None, "message": "internal error; it has been logged"}]}, status=500)
    return page(request)
