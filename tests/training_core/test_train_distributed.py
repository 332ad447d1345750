"""Data-parallel training with two real processes (gloo on CPU), as the deepspeed/torch
launchers start them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.training_core.conftest import start_server
from training_core.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]


def _env():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_two_ranks_make_the_same_update_as_one_process(tiny_model_dir, tmp_path, zero_stage):
    """Each rank trains on half the batch; with the global token normalisation the averaged
    gradient equals the single-process token mean, so the weights match."""
    outs = {}
    for name, launcher in (("one", [sys.executable]),
                           ("two", [*TORCHRUN, "--master_port", str(free_port())])):
        out = tmp_path / name
        run = subprocess.run([*launcher, str(ROOT / "tests/training_core/dist_step.py"),
                              str(tiny_model_dir), str(out), str(zero_stage)],
                             cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        outs[name] = load_file(str(out / "model.safetensors"))
        outs[name + "-stats"] = json.loads((out / "stats.json").read_text())
    one, two = outs.pop("one-stats"), outs.pop("two-stats")
    assert two["tokens"] == one["tokens"]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(outs["one"][name], base[name]), "the step changed the weights"
    # The all-reduce sums in another order (~1e-7 on a gradient), and Adam's first step moves a
    # weight by about lr * g / (|g| + eps): an element whose gradient is itself ~1e-7 can move
    # differently by a sizeable part of lr (seen: one of 32768 by 1.07e-5 on one CPU). So: almost
    # every element within 1e-5, none beyond 2 lr.
    for key, value in outs["one"].items():
        diff = (outs["two"][key] - value).abs()
        assert float(diff.max()) <= 2e-3, key
        assert int((diff > 1e-5).sum()) <= max(1, diff.numel() // 1000), key


@pytest.mark.slow
@pytest.mark.parametrize(("zero_stage", "weight_sync"), [(2, "disk"), (3, "distributed")])
def test_oolong_train_under_torchrun(tiny_model_dir, tmp_path, zero_stage, weight_sync):
    """Two ranks; with ZeRO-3 + distributed weight sync both ranks join the gather of every
    export and only rank 0 broadcasts to the server."""
    fleet, url = start_server(tiny_model_dir, tmp_path / "server.log")
    run_dir = tmp_path / "run"
    try:
        out = subprocess.run(
            [*TORCHRUN, "--master_port", str(free_port()), "-m", "training_core.cli", "train",
             "--no-progress", "model.path=tiny", f"run_dir={run_dir}", f"rollout.server_urls=[{url}]",
             "trainer.steps=3", "trainer.batch_groups=2", "rollout.group_size=2",
             "rollout.max_new_tokens=6", f"trainer.zero_stage={zero_stage}", "checkpoint.every=3",
             f"weight_sync={weight_sync}",
             "eval.every=0", "reward.fn=tests.training_core.rewards_for_tests:digit_reward"],
            cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        info = httpx.get(url + "/model_info").json()
    finally:
        fleet.stop()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3], "only rank 0 logs, once per step"
    assert info["weight_version"] == "3"
    assert (info["model_path"] == str(tiny_model_dir)) == (weight_sync == "distributed")
    ckpt = run_dir / "checkpoints" / "step3"
    assert (ckpt / "COMPLETE").exists()
    shards = sorted(p.name for p in ckpt.glob("*optim_states.pt"))
    assert len(shards) == 2, f"ZeRO keeps one optimizer shard per rank: {shards}"
