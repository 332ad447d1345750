"""When proximal logprobs are recomputed is one rule (training_core/proximal.py): the schema
resolves ``auto`` with it, the loop picks rows with it and the trainer checks its precondition
with it; no other module decides it again."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest
import torch

from training_core.config import TrainerSpec
from training_core.proximal import (
    ProximalSetting,
    proximal_rows,
    resolve_mode,
    update_gives_proximal,
)

pytestmark = pytest.mark.unit  # no process, network or database (conftest)

ROOT = Path(__file__).resolve().parents[3]

# Row 0: every output token from version 3 (the current one); row 1: one token from 2; row 2:
# prompt tokens (version -1, outside the loss mask) only older; row 3: all from 1.
VERSIONS = torch.tensor([[-1, -1, 3, 3], [-1, -1, 2, 3], [-1, -1, 3, 3], [-1, -1, 1, 1]])
MASK = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1]])


def rows(mode: str, version: int = 3, **kw) -> list[int] | None:
    args = {"decoupled": True, "minibatches": 2, **kw}
    return proximal_rows(mode=mode, versions=VERSIONS, loss_mask=MASK, version=version, **args)


def test_the_rows_needing_a_forward_are_exactly_the_stale_ones():
    assert rows("stale") == [1, 3]
    assert rows("always") == [0, 1, 2, 3]
    assert rows("never") == []
    assert rows("stale", version=4) == [0, 1, 2, 3]
    assert rows("stale", compute_rows=[0, 3]) == [3]  # only rows the update computes
    assert rows("always", compute_rows=[0, 3]) == [0, 1, 2, 3]


def test_one_minibatch_takes_them_from_the_update_and_other_cases_override_the_mode():
    assert rows("stale", minibatches=1) is None and rows("always", minibatches=1) is None
    assert rows("never", minibatches=1) == []  # behaviour stands in: w = 1
    assert rows("always", decoupled=False) == []  # no proximal policy at all
    assert rows("stale", collective_forward=True) == [0, 1, 2, 3]  # ZeRO-3: same forwards
    assert update_gives_proximal(1) and not update_gives_proximal(2)
    with pytest.raises(ValueError, match="'auto' is not resolved"):
        rows("auto")


@pytest.mark.parametrize(("backend", "dtype", "mode"), [
    ("embedded", "float32", "stale"), ("embedded", "bfloat16", "always"),
    ("embedded", "float16", "always"), ("sglang", "float32", "always"),
])
def test_auto_takes_the_shortcut_only_where_the_server_matches_the_trainer(backend, dtype, mode):
    assert resolve_mode("auto", backend=backend, dtype=dtype) == mode
    assert resolve_mode("never", backend=backend, dtype=dtype) == "never"


def test_the_schema_takes_its_settings_from_the_rule():
    assert set(get_args(TrainerSpec.model_fields["recompute_proximal"].annotation)) == \
        set(get_args(ProximalSetting))


def _decisions(path: Path) -> list[str]:
    """Where a module decides the rule itself: names a resolved mode, or compares a minibatch
    count with a number (the one-minibatch shortcut)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and node.value == "stale":
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} names 'stale'")
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", "")
                     for n in sides}
            if names & {"minibatches", "ppo_minibatches"} and any(
                    isinstance(n, ast.Constant) and isinstance(n.value, int) for n in sides):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} compares minibatches")
    return found


def test_no_module_but_proximal_py_decides_when_they_are_recomputed():
    rule = ROOT / "training_core" / "proximal.py"
    found = [hit for path in sorted((ROOT / "training_core").rglob("*.py")) if path != rule
             for hit in _decisions(path)]
    assert found == []
