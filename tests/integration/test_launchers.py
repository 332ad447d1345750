"""Trainer launch commands for the node inventories a provider can return."""

import sys

from orchestration.launchers import trainer_command
from orchestration.providers import Node, NodeInventory


def test_one_process_runs_without_the_launcher(tmp_path):
    cmd = trainer_command(tmp_path / "spec.yaml", ["http://a:1"], NodeInventory([Node("127.0.0.1")]), tmp_path)
    assert cmd[:3] == [sys.executable, "-m", "training_core.cli"]
    assert "rollout.server_urls=[http://a:1]" in cmd and "metrics.report_status=false" in cmd


def test_several_gpu_nodes_use_the_deepspeed_launcher_with_a_hostfile(tmp_path):
    inv = NodeInventory([Node("10.0.0.5", gpus=8, private_address="10.0.0.5"),
                         Node("10.0.0.6", gpus=8, private_address="10.0.0.6")])
    cmd = trainer_command(tmp_path / "spec.yaml", ["http://a:1", "http://b:1"], inv, tmp_path)
    assert cmd[0].endswith("deepspeed")
    assert cmd[cmd.index("--hostfile") + 1] == str(tmp_path / "hostfile")
    assert (tmp_path / "hostfile").read_text() == "10.0.0.5 slots=8\n10.0.0.6 slots=8\n"
    assert cmd[cmd.index("--master_addr") + 1] == "10.0.0.5"
    assert "--module" in cmd and "rollout.server_urls=[http://a:1,http://b:1]" in cmd


def test_resume_uses_the_run_directory(tmp_path):
    cmd = trainer_command(tmp_path / "spec.yaml", ["http://a:1"], NodeInventory([Node("x")]), tmp_path,
                          resume=True)
    assert cmd[cmd.index("--resume") + 1] == str(tmp_path)


def test_a_step_bounded_warm_start_is_reproducible_and_made_once(tmp_path):
    """model.warm_start_steps bounds the warm start by steps, not by how busy the machine is:
    two warm starts of the same spec give the same weights; a finished one is not made again."""
    from orchestration.launchers import warm_start
    from safetensors.torch import load_file

    from training_core.config import dump_spec, spec_from_dict

    spec = spec_from_dict({"model": {"warm_start_seconds": 600, "warm_start_steps": 3},
                           "data": {"size": 200}})
    weights = []
    for name in ("a", "b"):
        run_dir = tmp_path / name
        run_dir.mkdir()
        dump_spec(spec, run_dir / "spec.yaml")
        out = warm_start(spec, run_dir / "spec.yaml", run_dir)
        assert out == run_dir / "initial_model" and (out / "config.json").exists()
        assert not (run_dir / ".initial_model.partial").exists()
        weights.append(load_file(str(out / "model.safetensors")))
    assert weights[0].keys() == weights[1].keys()
    assert all(torch_equal(weights[0][k], weights[1][k]) for k in weights[0])
    stamp = (tmp_path / "a" / "initial_model" / "model.safetensors").stat().st_mtime_ns
    warm_start(spec, tmp_path / "a" / "spec.yaml", tmp_path / "a")
    assert (tmp_path / "a" / "initial_model" / "model.safetensors").stat().st_mtime_ns == stamp
    assert warm_start(spec_from_dict({}), tmp_path / "a" / "spec.yaml", tmp_path / "none") is None


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)
