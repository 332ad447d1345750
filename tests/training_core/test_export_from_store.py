"""Export of a run whose directory is on another node (issue 49.3): ``stage_from_store`` makes a
run directory from the durable checkpoint store (its local-filesystem form), and the export of a
LoRA run's checkpoint there (the adapter alone: the frozen base is not checkpointed) is the
trainer's adapter."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from training_core.checkpoint_store import CheckpointStore
from training_core.config import LoraSpec, load_spec
from training_core.export import ExportError, export_version, stage_from_store


def _lora_checkpoint_in_store(tiny_model_dir, tmp_path, step: int, version: int):
    from training_core.trainer.deepspeed_trainer import DeepSpeedTrainer

    trainer = DeepSpeedTrainer(tiny_model_dir, lr=1e-3, weight_decay=0.0, grad_clip=1.0,
                               zero_stage=0, lora=LoraSpec(rank=4, alpha=8))
    with torch.no_grad():
        for name, p in trainer.engine.module.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1)
    adapter, _ = trainer.adapter_weights()
    tag = f"step{step}"
    trainer.save_checkpoint(tmp_path / "node" / "checkpoints", tag, {"version": version})
    store = CheckpointStore(f"file://{tmp_path / 'store'}", "run-5")
    store.upload(tmp_path / "node" / "checkpoints" / tag, tag)
    store.mark_complete(tag)
    return store, {k: v.clone() for k, v in adapter.items()}


def test_a_lora_runs_checkpoint_in_the_store_exports_as_its_adapter(tiny_model_dir, tmp_path):
    store, adapter = _lora_checkpoint_in_store(tiny_model_dir, tmp_path, step=4, version=3)
    spec = load_spec(None, ["model.path=tiny", "model.lora.rank=4", "model.lora.alpha=8"])
    staged = stage_from_store(store, spec, "latest", tmp_path / "staged",
                              step_versions={1: 1, 2: 2, 4: 3})
    result = export_version(staged, "latest", tmp_path / "out")
    assert (result.version, result.step, result.source) == (3, 4, "checkpoint")
    got = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert set(got) == set(adapter)
    for name, tensor in adapter.items():
        assert torch.equal(got[name], tensor), name
    # a version the store does not hold, and a store without a known version, say so
    with pytest.raises(ExportError, match=r"held: \[3\]"):
        stage_from_store(store, spec, "2", tmp_path / "staged", step_versions={2: 2, 4: 3})
    with pytest.raises(ExportError, match="holds no complete checkpoint") as exc:
        stage_from_store(store, spec, "latest", tmp_path / "staged", step_versions={1: 1})
    assert exc.value.field == "run" and "step4" in str(exc.value)
