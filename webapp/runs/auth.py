"""Trainer-side authentication: a per-run ingest token (GPU nodes never hold user credentials or
database access)."""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

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


class IngestTokenScheme(OpenApiAuthenticationExtension):
    """The second security scheme in the OpenAPI schema: a run's ingest token as a Bearer token
    (user endpoints take the user's API token: ``Authorization: Token <key>``)."""

    target_class = "webapp.runs.auth.IngestTokenAuthentication"
    name = "runIngestToken"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer",
                "description": "a run's ingest token (issued when the run is created; void once "
                               "the run ends)"}
