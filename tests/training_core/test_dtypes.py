"""The run's dtype is one table (training_core/dtypes.py): the schema, the launcher, the
embedded server, the loaders, the trainer and the memory estimates all read it, and no other
module spells a dtype's name (a second copy of the rule would drift from the first)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest

from training_core import gpu_memory, launch
from training_core.config import ModelSpec, SpecError, load_spec
from training_core.dtypes import (
    DEFAULT_DTYPE,
    PRECISIONS,
    precision,
    sglang_dtype,
    torch_dtype,
    wire_name,
)

pytestmark = pytest.mark.unit  # no process, network or database (conftest)

ROOT = Path(__file__).resolve().parents[3]
SOURCES = ("training_core", "platform", "webapp", "workers")


def test_the_schema_allows_exactly_the_tables_dtypes_with_its_default():
    field = ModelSpec.model_fields["dtype"]
    assert set(get_args(field.annotation)) == set(PRECISIONS)
    assert field.default == DEFAULT_DTYPE == load_spec(None, []).model.dtype
    with pytest.raises(SpecError) as err:
        load_spec(None, ["model.dtype=int8"])
    assert "model.dtype" in str(err.value)


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_each_dtype_reaches_both_servers_flags_and_torch_from_the_table(name):
    embedded = launch.embedded_server_command("m", 1, dtype=name)
    sglang = launch.sglang_server_command("m", 1, dtype=name)
    assert embedded[embedded.index("--dtype") + 1] == name
    assert sglang[sglang.index("--dtype") + 1] == sglang_dtype(name)
    assert wire_name(torch_dtype(name)) == name
    assert torch_dtype("torch." + name) is torch_dtype(name)
    size = gpu_memory.ModelSize(params=1000, hidden=8, layers=1, vocab=10)
    assert gpu_memory.server_weight_bytes(size, dtype=name) == 1000 * precision(name).width
    assert torch_dtype(name).itemsize == precision(name).width


def test_a_bad_dtype_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="model.dtype 'int8' is not one of float32"):
        launch.embedded_server_command("m", 1, dtype="int8")
    with pytest.raises(ValueError, match="unknown dtype 'nope'"):
        torch_dtype("nope")


def test_bf16_trains_fp32_masters_under_autocast_and_serves_bf16():
    bf16, fp32 = precision("bfloat16"), precision(DEFAULT_DTYPE)
    assert bf16.trainer_weights == "float32" and bf16.autocast == "bfloat16"
    assert fp32.embedded_matches_trainer and not bf16.embedded_matches_trainer
    # fp32 masters beside the bf16 copy cost what an fp32 run's weights do
    assert gpu_memory.trainer_state_bytes(10, dtype="bfloat16", zero_stage=0, ranks=1) == \
        gpu_memory.trainer_state_bytes(10, dtype="float32", zero_stage=0, ranks=1) == 160
    assert gpu_memory.trainer_state_bytes(10, dtype="float16", zero_stage=0, ranks=1) == 160


def _dtype_literals(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), str(path))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in PRECISIONS]


def test_no_module_but_the_table_spells_a_dtype_name():
    """``"float32"`` as a default, a comparison or a choice list anywhere else is the rule
    written twice; read it from training_core.dtypes instead."""
    table = ROOT / "training_core" / "dtypes.py"
    found = [f"{path.relative_to(ROOT)}:{line}"
             for top in SOURCES for path in sorted((ROOT / top).rglob("*.py"))
             if path != table and "tests" not in path.parts for line in _dtype_literals(path)]
    assert found == []
