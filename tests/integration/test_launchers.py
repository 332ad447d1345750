"""Trainer launch commands for the node inventories a provider can return."""

import sys

import pytest

from training_core.launch import trainer_command


def test_one_process_runs_without_the_launcher(tmp_path):
    cmd = trainer_command(tmp_path / "spec.yaml", ["http://a:1"], tmp_path)
    assert cmd[:3] == [sys.executable, "-m", "training_core.cli"]
    assert "rollout.server_urls=[http://a:1]" in cmd and "metrics.report_status=false" in cmd


def test_several_gpus_run_one_rank_each_under_torchrun(tmp_path):
    cmd = trainer_command(tmp_path / "spec.yaml", ["http://a:1", "http://b:1"], tmp_path, nproc=4)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc_per_node") + 1] == "4" and "--standalone" in cmd
    assert "--module" in cmd and "rollout.server_urls=[http://a:1,http://b:1]" in cmd


def test_several_nodes_join_the_first_ones_rendezvous(tmp_path):
    cmd = trainer_command(tmp_path / "spec.yaml", ["http://a:1"], tmp_path, nproc=8, nnodes=2,
                          node_rank=1, master=("10.0.0.5", 29500),
                          overrides=("weight_sync=distributed",))
    assert "--standalone" not in cmd
    for flag, value in {"--nproc_per_node": "8", "--nnodes": "2", "--node_rank": "1",
                        "--master_addr": "10.0.0.5", "--master_port": "29500"}.items():
        assert cmd[cmd.index(flag) + 1] == value
    assert cmd[-1] == "weight_sync=distributed"
    with pytest.raises(ValueError, match="master"):
        trainer_command(tmp_path / "spec.yaml", [], tmp_path, nproc=1, nnodes=2)


def test_resume_uses_the_run_directory(tmp_path):
    cmd = trainer_command(tmp_path / "spec.yaml", ["http://a:1"], tmp_path, resume=True)
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


def test_sglang_runs_from_its_own_environment(monkeypatch):
    """SGLang 0.5.23 pins a torch the trainer's does not: nodes install it apart and say where."""
    from training_core.launch import sglang_server_command

    monkeypatch.delenv("OOLONG_SGLANG_PYTHON", raising=False)
    assert sglang_server_command("/m", 30000, dtype="bfloat16")[0] == sys.executable
    monkeypatch.setenv("OOLONG_SGLANG_PYTHON", "/opt/sglang/venv/bin/python")
    cmd = sglang_server_command("/m", 30000, tp=4, dtype="bfloat16")
    assert cmd[:3] == ["/opt/sglang/venv/bin/python", "-m", "sglang.launch_server"]
    assert cmd[cmd.index("--tp-size") + 1] == "4"
