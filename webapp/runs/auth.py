"""Trainer-side authentication: a per-run ingest token (GPU nodes never hold user credentials or
database access)."""

from __future__ import annotations

import time

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions
from rest_framework.throttling import BaseThrottle

from webapp.runs.models import token_hash
from webapp.runs.selectors import run_token_get


class RunIngestUser:
    """A run's token: its run, and what it was issued for (``creator``: shown once to whoever
    created the run; ``orchestrator``: the run's flow; ``node``: what the flow hands its nodes,
    sealed)."""

    is_authenticated = True
    is_anonymous = False

    def __init__(self, run, purpose: str = ""):
        self.run = run
        self.purpose = purpose

    def __str__(self) -> str:
        return f"ingest:{self.run.id}"


class IngestTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode()
        if not header.startswith(self.keyword + " "):
            return None
        found = run_token_get(token=header[len(self.keyword) + 1:].strip())
        if found is None:
            raise exceptions.AuthenticationFailed("unknown run ingest token")
        return RunIngestUser(found.run, found.purpose), found.run

    def authenticate_header(self, request) -> str:
        return self.keyword


class IngestRateThrottle(BaseThrottle):
    """At most settings.INGEST_RATE_PER_S requests per second per run token, counted over
    10-second windows (a burst within a window is fine); past it a 429 with Retry-After, which
    the trainer's sink waits out and retries (issue 47: a run token stored 42 MB in 2.4 s). A
    fixed-window counter in the shared cache: one increment per request."""

    WINDOW_S = 10

    def allow_request(self, request, view) -> bool:
        from django.conf import settings
        from django.core.cache import cache

        if not isinstance(request.user, RunIngestUser):
            return True  # not a run token: authentication answers
        header = authentication.get_authorization_header(request).decode(errors="replace")
        window = int(time.time()) // self.WINDOW_S
        key = f"ingest-rate:{token_hash(header)}:{window}"
        cache.add(key, 0, timeout=self.WINDOW_S * 2)
        try:
            count = cache.incr(key)
        except ValueError:  # expired between add and incr
            cache.add(key, 1, timeout=self.WINDOW_S * 2)
            count = 1
        self.retry_after = self.WINDOW_S - time.time() % self.WINDOW_S
        return count <= settings.INGEST_RATE_PER_S * self.WINDOW_S

    def wait(self) -> float:
        return self.retry_after


class IngestTokenScheme(OpenApiAuthenticationExtension):
    """The second security scheme in the OpenAPI schema: a run's ingest token as a Bearer token
    (user endpoints take the user's API token: ``Authorization: Token <key>``)."""

    target_class = "webapp.runs.auth.IngestTokenAuthentication"
    name = "runIngestToken"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer",
                "description": "a run's ingest token (issued when the run is created; void once "
                               "the run ends)"}
