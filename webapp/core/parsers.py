"""The JSON parser of every API endpoint (the unauthenticated token endpoint included).

DRF's ``JSONParser`` hands the body to ``json.load``, whose C decoder recurses once per ``[`` or
``{``: a 100 kB body of brackets raised RecursionError, a 500. Here a body nested deeper than
``MAX_BODY_DEPTH`` is a 400 naming the body:

- fewer than ``MAX_BODY_DEPTH`` brackets in all (most bodies): cannot be too deep, decoded as is;
- otherwise decoded (the decoder stops itself at the interpreter's recursion limit, a
  RecursionError that becomes the 400), then measured by an iterative walk over containers.

The decoder runs in C at full speed; the walk costs tens of milliseconds for a 100k-point ingest
body, while a pre-scan of the text with regular expressions cost seconds for a 10 MB body of
escaped quotes. Values are checked again, per field and more tightly, by
:func:`webapp.core.json_input.json_check` where they are stored.
"""

from __future__ import annotations

import json
from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

# Deeper than any spec or payload the API documents (json_input.MAX_DEPTH is 32 per field) and
# far below the interpreter's recursion limit.
MAX_BODY_DEPTH = 64


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists and dicts more than ``limit`` levels, without recursion."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in (node.values() if isinstance(node, dict) else node):
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


def _too_deep() -> ParseError:
    return ParseError(f"JSON parse error - the body is nested deeper than {MAX_BODY_DEPTH} "
                      "levels of arrays and objects")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON; send a finite number or null")


class BoundedJSONParser(JSONParser):
    """``JSONParser`` with a nesting limit; NaN and Infinity are refused as DRF's strict mode does."""

    def parse(self, stream, media_type=None, parser_context=None) -> Any:
        parser_context = parser_context or {}
        encoding = parser_context.get("encoding", "utf-8")
        raw = stream.read() if stream is not None else b""
        try:
            text = raw.decode(encoding)
        except (UnicodeDecodeError, LookupError) as exc:
            raise ParseError(f"JSON parse error - the body is not {encoding} text ({exc})") from None
        try:
            data = json.loads(text, parse_constant=_no_constant)
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        except RecursionError:  # the decoder reached the interpreter's limit: far too deep
            raise _too_deep() from None
        if text.count("[") + text.count("{") > MAX_BODY_DEPTH and \
                nested_deeper_than(data, MAX_BODY_DEPTH):
            raise _too_deep()
        return data
