"""The error services raise for bad input; the API layer renders it as a 4xx (webapp.api.errors)."""

from __future__ import annotations

from typing import Any


class ApplicationError(Exception):
    """Raised by services for bad input. ``errors`` is a list of {field, message, ...}."""

    def __init__(self, message: str, *, field: str | None = None,
                 errors: list[dict[str, Any]] | None = None, status_code: int = 400):
        super().__init__(message)
        self.message = message
        self.errors = errors or [{"field": field, "message": message}]
        self.status_code = status_code
