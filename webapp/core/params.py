"""Query-parameter parsing shared by the list APIs: bad values are 400s that name the field."""

from __future__ import annotations

import re

from django import forms
from rest_framework.exceptions import ValidationError

MAX_ID = 2**63 - 1  # ids and steps are 64-bit in the database
# ASCII digits only: str.isdigit() is true for "²" (which int() refuses, a 500 once) and int()
# takes "١٢", " 12", "+12" and "1_2", none of which is a number a client means to send.
_DIGITS = re.compile(r"[0-9]{1,19}")


def parse_count(raw: str | None) -> int | None:
    """``raw`` as a number between 0 and ``MAX_ID`` written in ASCII digits, else None."""
    if raw is None or not _DIGITS.fullmatch(raw):
        return None
    value = int(raw)
    return value if value <= MAX_ID else None


def int_param(request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    value = parse_count(raw)
    if value is None:
        raise ValidationError({name: f"must be an integer between 0 and {MAX_ID} in digits 0-9, "
                                     f"got {raw[:40]!r}"})
    return value


class IdFormField(forms.IntegerField):
    """A form's id or count: ASCII digits, 64-bit (a larger number was a database overflow)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("min_value", 1)
        kwargs.setdefault("max_value", MAX_ID)
        super().__init__(**kwargs)

    def to_python(self, value):
        if value in self.empty_values:
            return None
        text = str(value).strip()
        if parse_count(text) is None:
            raise forms.ValidationError(f"must be a whole number between {self.min_value} and "
                                        f"{MAX_ID} in digits 0-9", code="invalid")
        return int(text)


def paginated(request, view, queryset, serializer, *, max_limit: int):
    """A list API's page (``?limit=&offset=``, DRF's limit/offset shape). DRF's paginator
    ignores bad values; they are 400s here, like every other parameter."""
    from rest_framework.pagination import LimitOffsetPagination

    int_param(request, "offset")
    if int_param(request, "limit") == 0:
        raise ValidationError({"limit": "must be at least 1"})
    page = LimitOffsetPagination()
    page.max_limit = max_limit
    items = page.paginate_queryset(queryset, request, view=view)
    return page.get_paginated_response(serializer(items, many=True).data)


def choice_param(request, name: str, choices: list[str]) -> str | None:
    raw = request.query_params.get(name)
    if raw is not None and raw not in choices:
        raise ValidationError({name: f"must be one of {', '.join(choices)}"})
    return raw


def list_param(request, name: str, *, max_items: int, max_length: int = 200) -> list[str] | None:
    """A comma-separated list (``?keys=a,b``) with a bound on its size."""
    raw = request.query_params.get(name)
    if not raw:
        return None
    items = [item for item in raw.split(",") if item]
    if len(items) > max_items:
        raise ValidationError({name: f"at most {max_items} items"})
    if any(len(item) > max_length or "\x00" in item for item in items):
        raise ValidationError({name: f"items are at most {max_length} characters"})
    return items


class IdConverter:
    """``<id:run_id>`` in URLs: digits that fit a 64-bit id; longer numbers are a 404, never a
    database overflow."""

    regex = "[0-9]{1,18}"

    def to_python(self, value: str) -> int:
        return int(value)

    def to_url(self, value: int) -> str:
        return str(value)
