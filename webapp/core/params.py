"""Query-parameter parsing shared by the list APIs: bad values are 400s that name the field."""

from __future__ import annotations

from rest_framework.exceptions import ValidationError


def int_param(request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValidationError({name: f"must be an integer, got {raw!r}"}) from None
