"""A run's spec becomes a rollout server's command line and environment in one place
(launch.server_command and launch.server_env), which every starter uses (``oolong train``'s
start_fleet, the flows), and the embedded server parses exactly what it writes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from training_core.config import load_spec
from training_core.launch import server_command, server_env
from training_core.rollout_server.server import build_parser

pytestmark = pytest.mark.unit  # no process, network or database (conftest)

ROOT = Path(__file__).resolve().parents[3]
# what only the mapping from spec to server (and the server's own parser) may write
FLAGS = {"--model-path", "--weights-root", "--max-batch-size", "--tp-size",
         "--mem-fraction-static", "--weight-version", "--parent-pid", "sglang.launch_server",
         "training_core.rollout_server.server"}
MAPPING = {ROOT / "training_core" / "launch.py",
           ROOT / "training_core" / "rollout_server" / "server.py"}


def test_the_embedded_server_parses_what_the_spec_becomes(tmp_path):
    spec = load_spec(None, ["rollout.server_threads=3", "rollout.max_batch_size=17", "seed=5",
                            "model.dtype=bfloat16"])
    cmd = server_command(spec, "/models/m", 4321, 2, parent_pid=99, run_dir=tmp_path)
    assert cmd[1:3] == ["-m", "training_core.rollout_server.server"]
    args = build_parser().parse_args(cmd[3:])
    assert (args.model_path, args.port, args.threads, args.max_batch_size, args.seed,
            args.dtype, args.weights_root, args.parent_pid) == (
        "/models/m", 4321, 3, 17, 5 + 2, "bfloat16", str(tmp_path / "weights"), 99)
    # OpenMP's threads are the server's torch threads, whoever starts it
    assert server_env(spec, tmp_path)["OMP_NUM_THREADS"] == "3"


def test_the_servers_own_defaults_are_the_schemas():
    """``oolong serve --model-path DIR`` without a spec serves as a default run's server does."""
    spec = load_spec(None, [])
    args = build_parser().parse_args(["--model-path", "/m"])
    assert (args.threads, args.max_batch_size, args.dtype) == (
        spec.rollout.server_threads, spec.rollout.max_batch_size, spec.model.dtype)


def test_no_module_but_the_launcher_writes_a_servers_flags():
    found = []
    for top in ("training_core", "platform", "workers", "webapp", "benchmarks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path in MAPPING or "tests" in path.parts:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {node.value}"
                      for node in ast.walk(ast.parse(path.read_text(), str(path)))
                      if isinstance(node, ast.Constant) and node.value in FLAGS]
    assert found == []
