"""The launcher's production flags, sizing and environment, as pure functions (no process)."""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path

import pytest

from training_core import gpu_memory
from training_core.config import load_spec
from training_core.launch import (
    check_nccl,
    embedded_server_command,
    run_env,
    server_command,
    server_env,
    server_mem_fraction,
    single_machine_gpus,
)

pytestmark = pytest.mark.unit  # no process, network or database (conftest)

GIB = 1 << 30


def _arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def _model(tmp_path: Path, params: int, hidden: int = 4096, layers: int = 32,
           vocab: int = 32000) -> Path:
    """A model folder as gpu_memory sizes it: config.json and a safetensors header (no data)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(
        {"hidden_size": hidden, "num_hidden_layers": layers, "vocab_size": vocab}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [params], "data_offsets": [0, 0]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return tmp_path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_sglang_always_gets_the_runs_dtype_and_binds_loopback(dtype):
    """SGLang's dtype 'auto' serves an fp32 folder in fp16: a bf16 run sampled in fp16."""
    spec = load_spec(None, ["rollout.backend=sglang", f"model.dtype={dtype}"])
    cmd = server_command(spec, "/m", 30000, 0)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert _arg(cmd, "--dtype") == dtype
    assert _arg(cmd, "--host") == "127.0.0.1"  # loopback unless placed on a node
    assert "--mem-fraction-static" not in cmd  # a GPU of its own: SGLang sizes itself
    assert _arg(server_command(spec, "/m", 30000, 0, host="10.0.0.5"), "--host") == "10.0.0.5"
    embedded = server_command(load_spec(None, [f"model.dtype={dtype}"]), "/m", 30000, 0)
    assert _arg(embedded, "--dtype") == dtype and "training_core.rollout_server.server" in embedded


def test_the_sglang_key_travels_in_a_file_only_the_run_reads(tmp_path):
    spec = load_spec(None, ["rollout.backend=sglang"])
    cmd = server_command(spec, "/m", 30000, 2, run_dir=tmp_path, server_key="s3cret")
    assert "s3cret" not in " ".join(cmd)  # argv is world-readable in /proc
    config = Path(_arg(cmd, "--config"))
    assert config.parent == tmp_path and stat.S_IMODE(config.stat().st_mode) == 0o600
    assert config.read_text() == "api-key: s3cret\nadmin-api-key: s3cret\n"
    # a link planted where the file goes is replaced, never written through
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    config.unlink()
    config.symlink_to(target)
    server_command(spec, "/m", 30000, 2, run_dir=tmp_path, server_key="again")
    assert target.read_text() == "keep" and not config.is_symlink()
    with pytest.raises(ValueError, match="run directory"):
        server_command(spec, "/m", 30000, 2, server_key="k")
    env = run_env(tmp_path, 1, server_key="s3cret")
    assert env["OOLONG_SERVER_KEY"] == "s3cret"


def test_a_shared_gpu_leaves_the_trainer_what_it_needs(tmp_path):
    small = _model(tmp_path / "s", params=135_000_000, hidden=576, layers=30, vocab=49152)
    spec = load_spec(None, ["rollout.backend=sglang", "model.dtype=bfloat16"])
    fraction = server_mem_fraction(spec, small, shares_trainer_gpu=True, gpu_bytes=80 * GIB)
    assert 0.5 < fraction <= gpu_memory.MAX_SHARED_FRACTION
    # a 7B model trained with Adam on one 80 GiB GPU cannot leave a server room: refused, with
    # the numbers and what to change
    big = _model(tmp_path / "b", params=7_000_000_000)
    with pytest.raises(gpu_memory.GpuMemoryError,
                       match=r"shares GPU 0 \(80.0 GiB\) with a trainer rank that needs about "
                             r"1\d\d\.\d GiB.*trainer.zero_stage"):
        server_mem_fraction(spec, big, shares_trainer_gpu=True, gpu_bytes=80 * GIB)
    # its own GPU: SGLang sizes itself, unless the spec says
    assert server_mem_fraction(spec, big, shares_trainer_gpu=False) is None
    told = load_spec(None, ["rollout.backend=sglang", "rollout.mem_fraction=0.5"])
    assert server_mem_fraction(told, big, shares_trainer_gpu=False) == 0.5
    # an explicit fraction that, with the trainer, exceeds the shared GPU is refused
    too_much = load_spec(None, ["rollout.backend=sglang", "rollout.mem_fraction=0.9"])
    with pytest.raises(gpu_memory.GpuMemoryError, match=r"rollout.mem_fraction 0.90 .* Lower "
                                                         r"rollout.mem_fraction to at most 0\.\d\d"):
        server_mem_fraction(too_much, small, shares_trainer_gpu=True, gpu_bytes=24 * GIB)
    # the embedded server takes no fraction
    assert server_mem_fraction(load_spec(None, []), small, shares_trainer_gpu=True,
                               gpu_bytes=GIB) is None


def test_zero_stages_shard_the_trainers_states():
    one = gpu_memory.trainer_state_bytes(10**9, dtype="bfloat16", zero_stage=0, ranks=8)
    assert one == 16 * 10**9  # fp32 weights, gradients and Adam's two moments
    assert gpu_memory.trainer_state_bytes(10**9, dtype="bfloat16", zero_stage=1, ranks=8) == \
        (4 + 4 + 1) * 10**9
    assert gpu_memory.trainer_state_bytes(10**9, dtype="bfloat16", zero_stage=3, ranks=8) == \
        2 * 10**9


def test_one_machine_gives_servers_disjoint_gpus_and_refuses_what_nccl_cannot_do():
    spec = load_spec(None, ["rollout.num_servers=2"])
    assert single_machine_gpus(spec, 2) == ((0, 1), [(0,), (1,)])
    assert single_machine_gpus(spec, 0) == ((), [(), ()])
    with pytest.raises(ValueError, match="needs 2 GPUs and this machine has 1"):
        single_machine_gpus(spec, 1)
    with pytest.raises(ValueError, match="NCCL refuses"):
        single_machine_gpus(load_spec(None, ["weight_sync=distributed"]), 1)


def test_sglang_finds_its_own_tools_and_the_gpu_settings_pass(tmp_path, monkeypatch):
    """flashinfer compiles at first use with the ninja and nvcc of SGLang's environment; CUDA,
    allocator, compiler, SGLang and EFA settings reach the process; secrets do not."""
    monkeypatch.setenv("OOLONG_SGLANG_PYTHON", "/opt/sglang/venv/bin/python")
    monkeypatch.setenv("PATH", "/usr/bin")
    for name in ("CUDA_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "SGLANG_LOG_LEVEL",
                 "PYTORCH_CUDA_ALLOC_CONF", "FI_PROVIDER", "FLASHINFER_WORKSPACE_BASE",
                 "DATABASE_URL", "DJANGO_SECRET_KEY"):
        monkeypatch.setenv(name, "x")
    env = server_env(load_spec(None, ["rollout.backend=sglang"]), tmp_path, gpus=(3,))
    assert env["PATH"].split(os.pathsep)[:2] == ["/opt/sglang/venv/bin", "/usr/bin"]
    assert {"CUDA_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "SGLANG_LOG_LEVEL",
            "PYTORCH_CUDA_ALLOC_CONF", "FI_PROVIDER", "FLASHINFER_WORKSPACE_BASE"} <= env.keys()
    assert "DATABASE_URL" not in env and "DJANGO_SECRET_KEY" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    assert server_env(load_spec(None, []), tmp_path)["PATH"] == "/usr/bin"  # embedded: no change


def test_different_nccl_versions_on_the_two_ends_are_refused_naming_both(monkeypatch):
    from training_core import launch

    spec = load_spec(None, ["rollout.backend=sglang", "weight_sync=distributed"])
    versions = {"trainer": (2, 29, 7), "sglang": (2, 30, 7)}
    monkeypatch.setenv("OOLONG_SGLANG_PYTHON", "/opt/sglang/venv/bin/python")
    monkeypatch.setattr(launch, "nccl_version", lambda python: versions[
        "sglang" if python.startswith("/opt/sglang") else "trainer"])
    with pytest.raises(RuntimeError, match=r"NCCL 2\.29\.7 in the trainer's .* 2\.30\.7 in SGLang's"):
        check_nccl(spec)
    versions["trainer"] = (2, 30, 7)
    check_nccl(spec)
    # disk sync has no weight group: nothing to compare
    versions["trainer"] = (1, 0, 0)
    check_nccl(load_spec(None, ["rollout.backend=sglang"]))


def test_the_embedded_server_command_has_no_default_dtype():
    """The dtype is the run's (model.dtype), never a default in a signature."""
    with pytest.raises(TypeError):
        embedded_server_command("/m", 1)  # type: ignore[call-arg]
