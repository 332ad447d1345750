"""Check a request body against SGLang's request models as copied into
``fixtures/sglang_request_models.json`` (field names and types from SGLang's source)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "sglang_request_models.json").read_text())
MODELS: dict[str, dict] = FIXTURE["models"]
ENDPOINTS: dict[str, str | None] = FIXTURE["endpoints"]


def _matches(value: Any, spec: Any, where: str) -> list[str]:
    if isinstance(spec, list):  # a union: one branch must match without problems
        if any(not _matches(value, s, where) for s in spec):
            return []
        return [f"{where}: {value!r} matches none of {spec}"]
    if isinstance(spec, dict):
        return [] if value in spec["enum"] else [f"{where}: {value!r} not in {spec['enum']}"]
    if spec.startswith("list[") and spec.endswith("]"):
        if not isinstance(value, list):
            return [f"{where}: expected {spec}, got {type(value).__name__}"]
        inner = spec[5:-1]
        return [p for i, v in enumerate(value) for p in _matches(v, inner, f"{where}[{i}]")]
    if spec in MODELS:
        return check_model(spec, value, where)
    simple = {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "dict": lambda v: isinstance(v, dict),
        "null": lambda v: v is None,
        "any": lambda v: True,
    }
    return [] if simple[spec](value) else [f"{where}: expected {spec}, got {value!r}"]


def check_model(model: str, body: Any, where: str = "") -> list[str]:
    spec = MODELS[model]
    if not isinstance(body, dict):
        return [f"{where or model}: expected an object, got {type(body).__name__}"]
    problems = [f"{where or model}: missing required field {f!r}"
                for f in spec["required"] if f not in body]
    for key, value in body.items():
        path = f"{where}.{key}" if where else f"{model}.{key}"
        if key not in spec["fields"]:
            problems.append(f"{path}: SGLang's {model} has no such field")
        else:
            problems += _matches(value, spec["fields"][key], path)
    return problems


def check_request(method: str, path: str, body: Any) -> list[str]:
    key = f"{method} {path}"
    if key not in ENDPOINTS:
        return [f"{key}: not an endpoint of SGLang's native API (as of {FIXTURE['_sglang_version']})"]
    model = ENDPOINTS[key]
    return [] if model is None else check_model(model, body)
