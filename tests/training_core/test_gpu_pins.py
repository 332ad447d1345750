"""One NCCL on both ends of the weight-update group, on every GPU install path.

The trainer's environment on a GPU node installs with ``constraints-gpu.txt``, SGLang's with
``constraints-sglang.txt`` (scripts/gpu_constraints.py says why there are two). The NCCL each
environment loads is what its torch wheel pins, read here from PyPI's metadata for a Linux
x86_64 node (metadata only: no wheel is downloaded)."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_constraints", ROOT / "scripts/gpu_constraints.py")
gc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gc)


def test_the_gpu_trainers_pins_are_generated_from_constraints_txt_and_up_to_date():
    want = gc.gpu_constraints(gc.CPU.read_text(), gc.SGLANG.read_text())
    assert gc.GPU.read_text() == want, "run: python scripts/gpu_constraints.py"
    # every pin but torch is the CPU machines' own; torch is SGLang's
    cpu, gpu = gc.CPU.read_text(), gc.GPU.read_text()
    assert gc.pin(gpu, "torch") == gc.pin(gc.SGLANG.read_text(), "torch") != gc.pin(cpu, "torch")
    for name in ("deepspeed", "transformers", "openai", "prefect", "peft"):
        assert gc.pin(gpu, name) == gc.pin(cpu, name)


def test_the_project_admits_the_gpu_torch_and_pins_one_sglang_release():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_range = next(d for d in project["project"]["optional-dependencies"]["core"]
                       if d.startswith("torch"))
    gpu_torch = tuple(int(x) for x in gc.pin(gc.GPU.read_text(), "torch").split("."))
    low, high = (tuple(int(x) for x in v.split(".")) for v in
                 re.match(r"torch>=([\d.]+),<([\d.]+)", torch_range).groups())
    assert low <= gpu_torch < high, torch_range
    release = gc.pin(gc.SGLANG.read_text(), "sglang")
    assert gc.pin(gc.CPU.read_text(), "sglang") == release
    assert project["project"]["optional-dependencies"]["sglang"] == [f"sglang=={release}"]


def test_the_trainer_and_sglang_environments_load_the_same_nccl():
    """Resolved from the index's metadata: SGLang's torch pin, and the NCCL each torch pins."""
    try:
        sglang_torch = gc.required_pin(
            gc.requirements(f"sglang=={gc.pin(gc.SGLANG.read_text(), 'sglang')}"), "torch")
        trainer_torch = gc.pin(gc.GPU.read_text(), "torch")
        nccl = {"trainer": gc.nccl_of_torch(trainer_torch), "sglang": gc.nccl_of_torch(sglang_torch)}
        cpu_pin_nccl = gc.nccl_of_torch(gc.pin(gc.CPU.read_text(), "torch"))
    except Exception as exc:  # noqa: BLE001 - the index is the one thing this test needs
        pytest.fail(f"could not read the package index's metadata: {exc}")
    assert sglang_torch == gc.pin(gc.SGLANG.read_text(), "torch"), (
        "constraints-sglang.txt's torch is not the one the SGLang release pins")
    assert nccl["trainer"] == nccl["sglang"] is not None, nccl
    # The check can fail: the CPU machines' torch pin would load another NCCL (why the GPU file
    # exists at all).
    assert cpu_pin_nccl != nccl["sglang"]
