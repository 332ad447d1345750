"""JSON for the chart reads: their answers are long lists of floats (a comparison of 8 runs is
~800 KB), and encoding them with the standard library was half the request's CPU in the web
worker (22 ms of ~40 for a comparison; orjson: ~1 ms). The parsed answer is the same."""

from __future__ import annotations

from typing import Any

import orjson
from rest_framework.renderers import JSONRenderer
from rest_framework.utils.encoders import JSONEncoder

_fallback = JSONEncoder().default  # what DRF encodes beyond JSON's types (Decimal, lazy text)


class FastJSONRenderer(JSONRenderer):
    """DRF's JSON renderer through orjson: integer dict keys become strings as json.dumps makes
    them; a NaN or infinity becomes null (DRF's renderer fails the request on one: the ingest
    stores neither). An indented answer (``Accept: application/json; indent=2``) is DRF's, and
    so is one orjson cannot encode. U+2028/2029 are not escaped: these answers are read by
    ``fetch``, never pasted into a page's script."""

    def render(self, data: Any, accepted_media_type: str | None = None,
               renderer_context: dict | None = None) -> bytes:
        if data is None:
            return b""
        if self.get_indent(accepted_media_type or "", renderer_context or {}):
            return super().render(data, accepted_media_type, renderer_context)
        try:
            return orjson.dumps(data, default=_fallback, option=orjson.OPT_NON_STR_KEYS)
        except orjson.JSONEncodeError:  # an integer beyond 64 bits (a spec's seed may be one)
            return super().render(data, accepted_media_type, renderer_context)
