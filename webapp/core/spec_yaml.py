"""Run specs as YAML text: parsed safely (no aliases, bounded size) and written back compactly.
The run form's YAML view, the spec check endpoint and the dashboard forms share these."""

from __future__ import annotations

import math
from typing import Any

import yaml

from webapp.core.errors import ApplicationError

MAX_SPEC_CHARS = 100_000
MAX_SPEC_DEPTH = 32  # as json_input.MAX_DEPTH: the same spec sent as JSON has the same limit
# The tags of JSON's types. Anything else (!!binary, !!timestamp, !!set, !!python/...) is refused.
JSON_TAGS = frozenset(f"tag:yaml.org,2002:{name}"
                      for name in ("str", "int", "float", "bool", "null", "map", "seq"))


class _JsonTypesResolver(yaml.resolver.Resolver):
    """YAML 1.1's implicit types minus timestamps: ``2024-01-01`` is the text it looks like (a
    run spec is stored as JSON, which has no dates), and ``=`` and ``<<`` are plain text too."""


_JsonTypesResolver.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers
            if tag.rsplit(":", 1)[-1] not in ("timestamp", "merge", "value")]
    for first, resolvers in yaml.resolver.Resolver.yaml_implicit_resolvers.items()}


class _SpecLoader(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser,
                  yaml.composer.Composer, yaml.constructor.SafeConstructor, _JsonTypesResolver):
    """YAML as JSON: mappings with text keys, lists, text, numbers, booleans and null, nested at
    most ``MAX_SPEC_DEPTH`` levels. No anchors and aliases either: a run spec never needs them,
    and nested aliases expand exponentially (the 'billion laughs'). Every refusal is a
    ``yaml.YAMLError`` with the line, raised before anything deeper is composed (PyYAML's
    composer recurses per level: unbounded nesting was a RecursionError, a 500)."""

    def __init__(self, stream: str):
        yaml.reader.Reader.__init__(self, stream)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        yaml.composer.Composer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        _JsonTypesResolver.__init__(self)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.MarkedYAMLError(None, None, "YAML aliases (*name) are not allowed in a run "
                                       "spec", self.peek_event().start_mark)
        if self._depth >= MAX_SPEC_DEPTH and self.check_event(
                yaml.MappingStartEvent, yaml.SequenceStartEvent):
            raise yaml.MarkedYAMLError(None, None, f"nested deeper than {MAX_SPEC_DEPTH} levels",
                                       self.peek_event().start_mark)
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if node.tag not in JSON_TAGS:
            raise yaml.MarkedYAMLError(None, None, f"the tag {node.tag.replace('tag:yaml.org,2002:', '!!')} is not "
                                       "allowed: a run spec holds JSON's types only (text, "
                                       "numbers, true/false, null, lists, mappings)", node.start_mark)
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        mapping = super().construct_mapping(node, deep=deep)
        for key_node, _ in node.value:
            if key_node.tag != "tag:yaml.org,2002:str":
                raise yaml.MarkedYAMLError(None, None, "keys must be text (JSON has no other "
                                           "keys); quote it", key_node.start_mark)
        return mapping

    def construct_yaml_float(self, node: Any) -> float:
        value = super().construct_yaml_float(node)
        if not math.isfinite(value):
            raise yaml.MarkedYAMLError(None, None, "must be a finite number (JSON has no "
                                       ".inf or .nan)", node.start_mark)
        return value


_SpecLoader.add_constructor("tag:yaml.org,2002:float", _SpecLoader.construct_yaml_float)


def spec_from_yaml(text: str, *, field: str = "spec") -> dict[str, Any]:
    """A mapping of sections. Raises ApplicationError naming ``field`` (and the line, when YAML
    says where)."""
    if len(text) > MAX_SPEC_CHARS:
        raise ApplicationError(f"the spec is longer than {MAX_SPEC_CHARS} characters", field=field)
    try:
        data = yaml.load(text or "{}", Loader=_SpecLoader) or {}  # noqa: S506 - JSON types only
    except (yaml.YAMLError, RecursionError) as exc:  # RecursionError: never, kept as a guard
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        where = f" (line {line})" if line else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ApplicationError(f"not valid YAML{where}: {problem}",
                               errors=[{"field": field, "message": f"not valid YAML: {problem}",
                                        "line": line}]) from None
    if not isinstance(data, dict):
        raise ApplicationError("the spec must be a mapping of sections (trainer:, rollout:, ...)",
                               field=field)
    return data


def spec_to_yaml(spec: dict[str, Any]) -> str:
    """Section order as given, block style; an empty spec is an empty text."""
    return yaml.safe_dump(spec, sort_keys=False, default_flow_style=False) if spec else ""
