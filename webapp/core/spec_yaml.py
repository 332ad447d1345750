"""Run specs as YAML text: parsed safely (no aliases, bounded size) and written back compactly.
The run form's YAML view, the spec check endpoint and the dashboard forms share these."""

from __future__ import annotations

from typing import Any

import yaml

from webapp.core.errors import ApplicationError

MAX_SPEC_CHARS = 100_000


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without anchors and aliases: a run spec never needs them, and nested aliases expand
    exponentially (the 'billion laughs')."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError("YAML aliases (*name) are not allowed in a run spec")
        return super().compose_node(parent, index)


def spec_from_yaml(text: str, *, field: str = "spec") -> dict[str, Any]:
    """A mapping of sections. Raises ApplicationError naming ``field`` (and the line, when YAML
    says where)."""
    if len(text) > MAX_SPEC_CHARS:
        raise ApplicationError(f"the spec is longer than {MAX_SPEC_CHARS} characters", field=field)
    try:
        data = yaml.load(text or "{}", Loader=_NoAliasLoader) or {}  # noqa: S506 - safe loader
    except yaml.YAMLError as exc:
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
