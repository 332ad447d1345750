"""Trainer-side authentication: a per-run ingest token (GPU nodes never hold user credentials or
database access)."""

from __future__ import annotations

from rest_framework import authentication, exceptions

from webapp.runs.selectors import run_get_by_ingest_token


class RunIngestUser:
    is_authenticated = True
    is_anonymous = False

    def __init__(self, run):
        self.run = run

    def __str__(self) -> str:
        return f"ingest:{self.run.id}"


class IngestTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode()
        if not header.startswith(self.keyword + " "):
            return None
        run = run_get_by_ingest_token(token=header[len(self.keyword) + 1:].strip())
        if run is None:
            raise exceptions.AuthenticationFailed("unknown run ingest token")
        return RunIngestUser(run), run

    def authenticate_header(self, request) -> str:
        return self.keyword
