"""A LoRA run end to end on CPU (issue 49): the embedded server, the trainer with an adapter, a
KL preset whose reference is the base with the adapter off, adapter-only pushes, and a resume."""

from __future__ import annotations

import json

import httpx
import pytest
from safetensors.torch import load_file

from tests.training_core.conftest import start_server
from tests.training_core.test_train_e2e import SMALL
from training_core.config import load_spec
from training_core.metrics import read_metrics

LORA = [*SMALL, "model.lora.rank=4", "model.lora.alpha=8", "trainer.lr=1e-2",
        "algorithm.preset=ppo_kl", "rollout.group_size=4", "eval.every=0", "checkpoint.every=1"]


@pytest.mark.parametrize("pause_mode", ["in_place", "abort"])
def test_a_lora_run_pushes_only_adapters_and_resumes(tiny_model_dir, tmp_path, pause_mode):
    """Both ways a push meets samples in flight: they go on under the new adapter (in_place),
    or come back and are sent again naming it (abort); each token keeps its version."""
    from training_core.train import train

    fleet, url = start_server(tiny_model_dir, tmp_path / "server.log")
    run_dir = tmp_path / "run"
    try:
        common = [*LORA, f"run_dir={run_dir}", f"rollout.server_urls=[{url}]",
                  f"rollout.pause_mode={pause_mode}", "rollout.max_staleness=1"]
        train(load_spec(None, [*common, "trainer.steps=2"]), progress=False)
        resumed = train(load_spec(None, [*common, "trainer.steps=3"]), resume_dir=run_dir,
                        progress=False)
        info = httpx.get(url + "/model_info").json()
        probe = httpx.post(url + "/generate", json={
            "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}, "lora_path": "v1"})
    finally:
        fleet.stop()
    assert resumed.last_step == 3
    steps = [r for r in read_metrics(run_dir) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["tokens/consumed"] > 0 for r in steps)
    assert all(r["staleness/max"] <= 1 for r in steps)
    # every pushed version is an adapter folder, nothing of the full model
    folders = sorted(p for p in (run_dir / "weights").glob("v*") if p.is_dir())
    assert folders, "no weights pushed"
    for folder in folders:
        assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json",
                                                            "adapter_model.safetensors"]
        assert all(".lora_" in k for k in load_file(str(folder / "adapter_model.safetensors")))
    # the server holds the last version, and the older adapters were unloaded
    assert info["weight_version"] == "3"
    assert probe.status_code == 400 and "v1" in probe.json()["error"]["message"]
    kinds = [json.loads(line)["kind"] for line in (run_dir / "events.jsonl").open()]
    assert "resumed" in kinds and kinds[-1] == "finished"
