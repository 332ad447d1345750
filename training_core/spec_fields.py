"""The run spec as a flat list of fields, for forms and docs: dotted path, kind, default,
bounds, choices and help text, read from :class:`~training_core.config.RunSpec`'s JSON schema
(so a field added to the spec shows up in the web app's run form with no other change).

Kinds: ``integer``, ``number``, ``boolean``, ``string``, ``choice`` (``choices`` holds the
allowed values), ``list`` (of scalars; ``item_kind``) and ``mapping`` (free-form, edited as
YAML). ``nullable`` fields may be left empty (None: "use the default rule", e.g. the preset's
value).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from training_core.config import RunSpec

_SCALARS = {"integer", "number", "boolean", "string"}


def _deref(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    return defs[ref.rsplit("/", 1)[-1]] if ref else schema


def _describe(prop: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any] | None:
    """Kind and constraints of one property; None for a nested section (recursed into)."""
    options = prop.get("anyOf", [prop])
    nullable = any(o.get("type") == "null" for o in options)
    real = [_deref(o, defs) for o in options if o.get("type") != "null"]
    body = real[0] if real else {}
    if body.get("properties") and not nullable:
        return None
    out: dict[str, Any] = {"nullable": nullable}
    if "enum" in body:
        out.update(kind="choice", choices=list(body["enum"]))
    elif body.get("type") in _SCALARS:
        out["kind"] = body["type"]
    elif body.get("type") == "array" and body.get("items", {}).get("type") in _SCALARS:
        out.update(kind="list", item_kind=body["items"]["type"])
    else:  # a free mapping, a list of mappings, an optional section
        out["kind"] = "mapping"
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "pattern"):
        if key in body:
            out[key] = body[key]
    return out


@lru_cache(maxsize=1)
def _fields() -> tuple[dict[str, Any], ...]:
    schema = RunSpec.model_json_schema()
    defs = schema.get("$defs", {})
    defaults = RunSpec().model_dump(mode="json")
    found: list[dict[str, Any]] = []

    def walk(node: dict[str, Any], prefix: str, default: dict[str, Any]) -> None:
        for name, prop in node.get("properties", {}).items():
            path = f"{prefix}{name}"
            info = _describe(prop, defs)
            if info is None:
                walk(_deref(prop.get("anyOf", [prop])[0], defs), path + ".", default.get(name, {}))
                continue
            found.append({"path": path, "section": prefix.split(".", 1)[0] or "run",
                          "name": name, "default": default.get(name),
                          "description": prop.get("description", ""), **info})

    walk(schema, "", defaults)
    return tuple(found)


def spec_fields() -> list[dict[str, Any]]:
    """Every settable field of the run spec, in schema order (a copy: callers may annotate)."""
    return [dict(f) for f in _fields()]


def spec_json_schema() -> dict[str, Any]:
    return RunSpec.model_json_schema()


def overrides_of(resolved: dict[str, Any]) -> dict[str, Any]:
    """The part of a resolved spec that differs from the defaults, as a nested mapping: what a
    user would have written to get it (a clone's starting point, a compact YAML view)."""
    defaults = RunSpec().model_dump(mode="json")

    def diff(value: Any, default: Any) -> Any:
        if isinstance(value, dict) and isinstance(default, dict):
            out = {k: d for k, v in value.items()
                   if (d := diff(v, default.get(k, _MISSING))) is not _MISSING}
            return out or _MISSING
        return _MISSING if value == default else value

    found = diff(resolved, defaults)
    return {} if found is _MISSING else found


_MISSING = object()
