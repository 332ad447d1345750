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


@lru_cache(maxsize=2)
def _fields(inside_optional: bool = False) -> tuple[dict[str, Any], ...]:
    schema = RunSpec.model_json_schema()
    defs = schema.get("$defs", {})
    defaults = RunSpec().model_dump(mode="json")
    found: list[dict[str, Any]] = []

    def walk(node: dict[str, Any], prefix: str, default: dict[str, Any], within: str) -> None:
        for name, prop in node.get("properties", {}).items():
            path = f"{prefix}{name}"
            info = _describe(prop, defs)
            if info is None:
                walk(_deref(prop.get("anyOf", [prop])[0], defs), path + ".",
                     default.get(name, {}), within)
                continue
            section = _optional_section(prop, defs)
            if inside_optional and section is not None:
                walk(section, path + ".", default.get(name) or {}, path)
            if inside_optional and not within:
                continue
            found.append({"path": path, "section": prefix.split(".", 1)[0] or "run",
                          "name": name, "default": default.get(name),
                          "description": prop.get("description", ""), **info,
                          **({"within": within} if within else {})})

    walk(schema, "", defaults, "")
    return tuple(found)


def _optional_section(prop: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any] | None:
    """The schema of a section that may be left empty (``model.lora``), else None."""
    options = [_deref(o, defs) for o in prop.get("anyOf", []) if o.get("type") != "null"]
    return options[0] if len(options) == 1 and options[0].get("properties") else None


def optional_section_fields() -> list[dict[str, Any]]:
    """The fields inside sections that may be left empty (``model.lora.rank``; ``within`` names
    the section). Not in :func:`spec_fields`: the form edits such a section as one mapping (a
    default filled in for each of its fields would turn it on); member limits bound them."""
    return [dict(f) for f in _fields(True)]


def spec_fields() -> list[dict[str, Any]]:
    """Every settable field of the run spec, in schema order (a copy: callers may annotate)."""
    return [dict(f) for f in _fields(False)]


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
