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


# ---- the release itself: re-derive routes and request models from SGLang's source -----------
# The fixture is checked against the pinned release's files when they are at hand (an installed
# ``sglang`` of that version, or ``$OOLONG_SGLANG_SOURCE``: a folder holding the unpacked wheel,
# ``pip download --no-deps sglang==<version>`` then ``unzip``). Parsed, never imported: importing
# SGLang needs CUDA and its whole dependency tree.

SGLANG_VERSION: str = FIXTURE["_sglang_version"]
SOURCE_ENV = "OOLONG_SGLANG_SOURCE"


def release_source_or_skip() -> Path:
    """The release's source for a test; a skip where it is absent, a failure under ``make test``
    (scripts/test.sh fetches it and sets OOLONG_REQUIRE_SGLANG_SOURCE)."""
    import os

    import pytest

    root = release_source()
    if root is not None:
        return root
    message = (f"SGLang {SGLANG_VERSION}'s source is not here: scripts/test.sh fetches it; or set "
               f"{SOURCE_ENV} to an unpacked `pip download --no-deps sglang=={SGLANG_VERSION}`")
    if os.environ.get("OOLONG_REQUIRE_SGLANG_SOURCE") == "1":
        pytest.fail(message)
    pytest.skip(message)


def release_source() -> Path | None:
    """The folder holding the ``sglang`` package of the pinned release, None when absent."""
    import os
    from importlib import metadata

    if os.environ.get(SOURCE_ENV):
        root = Path(os.environ[SOURCE_ENV])
        return root if (root / "sglang").is_dir() else None
    try:
        dist = metadata.distribution("sglang")
    except metadata.PackageNotFoundError:
        return None
    return Path(str(dist.locate_file(""))) if dist.version == SGLANG_VERSION else None


def release_routes(root: Path) -> dict[str, str | None]:
    """``"METHOD /path"`` -> the request model its handler takes (None: no body model), from the
    ``@app.get/post/api_route`` decorators of SGLang's HTTP server."""
    import ast

    tree = ast.parse((root / "sglang/srt/entrypoints/http_server.py").read_text())
    routes: dict[str, str | None] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        model = _body_model(fn)
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app"
                    and dec.args and isinstance(dec.args[0], ast.Constant)):
                continue
            kind = dec.func.attr
            if kind == "api_route":
                methods = next((ast.literal_eval(k.value) for k in dec.keywords
                                if k.arg == "methods"), ["GET"])
            elif kind in {"get", "post", "put", "delete"}:
                methods = [kind.upper()]
            else:
                continue
            for method in methods:
                routes[f"{method} {dec.args[0].value}"] = model
    return routes


def _body_model(fn) -> str | None:
    import ast

    for arg in fn.args.args:
        ann = arg.annotation
        if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "Annotated":
            ann = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
        name = ast.unparse(ann) if ann is not None else ""
        if name.endswith(("ReqInput", "Req")):
            return name
    return None


def release_models(root: Path) -> dict[str, dict[str, bool]]:
    """Class name -> {field: has a default} for the request models and SamplingParams, with
    the fields of their bases (``BaseReq``'s ``rid``) folded in."""
    import ast

    classes: dict[str, ast.ClassDef] = {}
    for rel in ("sglang/srt/managers/io_struct.py", "sglang/srt/sampling/sampling_params.py"):
        for node in ast.parse((root / rel).read_text()).body:
            if isinstance(node, ast.ClassDef):
                classes[node.name] = node

    def fields(name: str) -> dict[str, bool]:
        node = classes.get(name)
        if node is None:
            return {}
        out: dict[str, bool] = {}
        for base in node.bases:
            out.update(fields(ast.unparse(base)))
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                out[stmt.target.id] = stmt.value is not None
        return out

    return {name: fields(name) for name in classes}


def release_cli_flags(root: Path) -> set[str]:
    """``--flag`` spellings of SGLang's server arguments (field names and their aliases)."""
    import re

    flags: set[str] = set()
    # the fields, and the flags the parser adds itself (--config: a YAML file of the same keys)
    for path in [*(root / "sglang/srt/arg_groups/fields").glob("*.py"),
                 root / "sglang/srt/server_args.py"]:
        text = path.read_text()
        flags |= {"--" + m.replace("_", "-")
                  for m in re.findall(r"^    ([a-z][a-z0-9_]*): A\[", text, re.M)}
        flags |= set(re.findall(r'"(--[a-z0-9-]+)"', text))
    return flags
