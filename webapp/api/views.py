"""One API class per operation; REST puts list (GET) and create (POST) on one URL, so the URL
gets a class combining the two (still a real APIView, so the OpenAPI schema sees both)."""

from __future__ import annotations


def combine(name: str, *apis: type) -> type:
    return type(name, tuple(apis), {"__doc__": " / ".join(a.__doc__ or a.__name__ for a in apis)})
