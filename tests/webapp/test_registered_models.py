"""The models a project member may train are the ones training_core.models.paths builds (one
list, REGISTERED_MODELS); the web app's policy offers exactly those and spells none of them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from training_core.models.paths import REGISTERED_MODELS, resolve_model_dir

ROOT = Path(__file__).resolve().parents[2]


def test_members_choose_among_the_models_training_core_builds():
    from webapp.runs.policy import member_choices

    assert member_choices()["model.path"] == list(REGISTERED_MODELS)
    with pytest.raises(FileNotFoundError, match=", ".join(REGISTERED_MODELS)):
        resolve_model_dir(str(ROOT / "no-such-model"))


def test_no_web_or_platform_module_spells_a_registered_model():
    found = [f"{path.relative_to(ROOT)}:{node.lineno} {node.value}"
             for top in ("webapp", "workers", "platform") for path in sorted((ROOT / top).rglob("*.py"))
             if "tests" not in path.parts
             for node in ast.walk(ast.parse(path.read_text(), str(path)))
             if isinstance(node, ast.Constant) and node.value in REGISTERED_MODELS]
    assert found == []
