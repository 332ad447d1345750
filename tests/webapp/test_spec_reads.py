"""The web app reads a run's settings through one selector (runs.selectors.run_spec_resolved),
which fills every default from the schema: never a ``.get(key, default)`` of its own on the
stored dict, whose default drifts from the trainer's (max_staleness read 0 where runs ran at 1)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SELECTOR = ROOT / "webapp" / "runs" / "selectors.py"


def test_the_run_header_counts_steps_by_the_schemas_default(run):
    from training_core.config import RunSpec
    from webapp.tracking.selectors import run_glance

    del run.spec["trainer"]["steps"]
    run.save(update_fields=["spec"])
    assert run_glance(run=run, latest={})["total"] == RunSpec().trainer.steps


def _raw_reads(path: Path) -> list[str]:
    """``<x>.spec.get(...)``, ``(<x>.spec or {}).get(...)``, ``<x>.spec[...]`` and
    ``spec_from_dict(<x>.spec)``: a value read from a stored spec around the selector."""
    def is_spec(node: ast.AST) -> bool:
        if isinstance(node, ast.BoolOp):
            return any(is_spec(v) for v in node.values)
        return isinstance(node, ast.Attribute) and node.attr == "spec"

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "get" and is_spec(node.value) or \
                isinstance(node, ast.Subscript) and is_spec(node.value) or \
                isinstance(node, ast.Call) and getattr(node.func, "id", "") == "spec_from_dict" \
                and any(is_spec(a) for a in node.args):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_web_module_reads_a_stored_spec_around_the_selector():
    found = [hit for top in ("webapp", "workers") for path in sorted((ROOT / top).rglob("*.py"))
             if path != SELECTOR and "tests" not in path.parts and "migrations" not in path.parts
             for hit in _raw_reads(path)]
    assert found == []
