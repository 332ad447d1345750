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
