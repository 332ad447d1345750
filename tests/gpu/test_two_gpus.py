"""Two or more GPUs (issue 45): a 2-rank trainer on NCCL (its collectives on each rank's GPU,
training_core/world.py), the weight-update group made beside the trainer's communicator
(transport/weight_group.py), NCCL weight pushes to an embedded server on a GPU trainer rank 0
does not use, and the server's weights and version checked after the pushes. The CPU twin is
tests/training_core/test_train_distributed.py (gloo); skipped with fewer than two GPUs."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.gpu.gpus import ROOT, child_env, cuda_gpus, needs_gpus, smollm2_dir
from training_core.launch import embedded_server_command, server_process
from training_core.ports import free_port
from training_core.processes import Fleet

pytestmark = needs_gpus(2)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]


def _server_on(gpu: int, model_dir, log_path, dtype: str) -> tuple[Fleet, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = embedded_server_command(str(model_dir), port, dtype=dtype, seed=0)
    server = server_process("gpu test server", cmd, url, log_path,
                            env=child_env(CUDA_VISIBLE_DEVICES=str(gpu))).start()
    fleet = Fleet(urls=[url], servers=[server])
    fleet.wait_healthy(300)
    return fleet, url


@pytest.mark.slow
def test_two_ranks_push_over_nccl_to_a_server_on_another_gpu(tmp_path):
    """Trainer ranks on GPUs 0 and 1; the server on GPU 2 when there is one, else on GPU 1,
    beside rank 1, which is not in the weight group: the group's two ranks (trainer rank 0 and
    the server) are on different GPUs either way, as NCCL requires. ZeRO-3: every export is a
    gather all ranks join before rank 0 broadcasts (the path with the most collectives)."""
    model_dir = smollm2_dir()
    server_gpu = 2 if cuda_gpus() >= 3 else 1
    fleet, url = _server_on(server_gpu, model_dir, tmp_path / "server.log", "bfloat16")
    run_dir = tmp_path / "run"
    try:
        out = subprocess.run(
            [*TORCHRUN, "--master_port", str(free_port()), "-m", "training_core.cli", "train",
             "--no-progress", "model.path=smollm2", "model.dtype=bfloat16", f"run_dir={run_dir}",
             f"rollout.server_urls=[{url}]", "rollout.backend=embedded",
             "weight_sync=distributed", "trainer.zero_stage=3",
             "trainer.dist_backend=nccl", "trainer.steps=3", "trainer.batch_groups=2",
             "rollout.group_size=2", "rollout.max_new_tokens=16", "rollout.max_staleness=1",
             "data.chat_template=true", "data.prompt_template='What is {question}?'",
             "trainer.lr=1e-5", "eval.every=0", "checkpoint.every=3",
             # inline and built in: the reward jail (namespaces, seccomp) is not a GPU question
             "reward.fn=builtin:numeric", "reward.executor=inline"],
            cwd=ROOT, env=child_env(CUDA_VISIBLE_DEVICES="0,1"), capture_output=True,
            text=True, timeout=480)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
        info = httpx.get(url + "/model_info", timeout=30).json()
        server = httpx.get(url + "/server_info", timeout=30).json()
    finally:
        fleet.stop()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3], "only rank 0 logs, once per step"
    assert info["weight_version"] == "3", info
    assert info["model_path"] == str(model_dir), "pushed over NCCL, never loaded from disk"
    assert server["device"].startswith("cuda") and server["dtype"] == "bfloat16", server
    assert not (run_dir / "weights").exists() or not list((run_dir / "weights").glob("*/*"))
    ckpt = run_dir / "checkpoints" / "step3"
    assert (ckpt / "COMPLETE").exists()
    assert len(list(ckpt.glob("*optim_states.pt"))) == 2, "one optimizer shard per rank"
