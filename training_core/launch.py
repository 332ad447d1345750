"""The one launcher: every command line and environment of a run's processes (rollout servers,
embedded or SGLang; the trainer, one process or ``torch.distributed.run`` ranks on one or several
nodes), for ``oolong train``'s embedded fleet, the single-machine flow and placed runs alike.

The environment is always the allow-list of ``processes.process_env`` plus what the run adds
(its directory on ``PYTHONPATH``, its id, the GPUs a placed process owns). Their lifecycle
(spawn, health, restart, stop) is ``training_core/processes.py``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from training_core.config import RunSpec
from training_core.ports import free_port
from training_core.processes import Fleet, ManagedProcess, process_env

SGLANG_PYTHON_ENV = "OOLONG_SGLANG_PYTHON"  # the interpreter of SGLang's own environment
# A node announces the address other nodes reach it at (set by the node's worker); otherwise the
# address this machine uses to reach the first server (weight_sync.node_address).
NODE_ADDRESS_ENV = "OOLONG_NODE_ADDRESS"


def embedded_server_command(model_path: str, port: int, *, host: str = "127.0.0.1",
                            threads: int = 1, max_batch_size: int = 256, seed: int = 0,
                            weight_version: int = 0, parent_pid: int | None = None,
                            dtype: str = "float32") -> list[str]:
    cmd = [sys.executable, "-m", "training_core.rollout_server.server", "--model-path",
           str(model_path), "--host", host, "--port", str(port), "--threads", str(threads),
           "--max-batch-size", str(max_batch_size), "--seed", str(seed),
           "--weight-version", str(weight_version), "--dtype", dtype]
    return cmd + (["--parent-pid", str(parent_pid)] if parent_pid else [])


def sglang_server_command(model_path: str, port: int, *, host: str = "0.0.0.0", tp: int = 1,
                          mem_fraction: float = 0.8, weight_version: int = 0,
                          extra: list[str] | None = None) -> list[str]:
    """The production rollout server. Flags per SGLang's server arguments; it starts at a known
    ``weight_version`` (the trainer checks it through ``/model_info``). SGLang pins its own torch,
    so it may live in an environment of its own: ``$OOLONG_SGLANG_PYTHON`` (cloud-init sets it)."""
    python = os.environ.get(SGLANG_PYTHON_ENV) or sys.executable
    return [python, "-m", "sglang.launch_server", "--model-path", str(model_path),
            "--host", host, "--port", str(port), "--tp-size", str(tp),
            "--mem-fraction-static", str(mem_fraction), "--skip-tokenizer-init",
            "--weight-version", str(weight_version), *(extra or [])]


def server_command(spec: RunSpec, model_dir: str, port: int, index: int, *,
                   host: str | None = None, parent_pid: int | None = None) -> list[str]:
    """Rollout server ``index`` of the run: SGLang (``rollout.tp`` GPUs) or the embedded server
    (each binds to its own default address unless ``host`` is given)."""
    where = {"host": host} if host else {}
    if spec.rollout.backend == "sglang":
        return sglang_server_command(model_dir, port, tp=spec.rollout.tp, **where)
    return embedded_server_command(model_dir, port, threads=spec.rollout.server_threads,
                                   max_batch_size=spec.rollout.max_batch_size,
                                   seed=spec.seed + index, parent_pid=parent_pid,
                                   dtype=spec.model.dtype, **where)


def run_env(run_dir: Path, run_id: int | None = None,
            gpus: tuple[int, ...] | list[int] | None = None) -> dict[str, str]:
    """The allow-listed environment of a run's processes, with the run directory importable
    (user reward modules are written there), the run id that marks them and, for a placed
    process, the GPUs it owns (``CUDA_VISIBLE_DEVICES``: it sees those and no other)."""
    path = os.pathsep.join(p for p in [str(run_dir), os.environ.get("PYTHONPATH", "")] if p)
    extra = {"PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if run_id is not None:
        extra["OOLONG_RUN_ID"] = str(run_id)
    if gpus:
        extra["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    return process_env(extra)


def train_args(spec_path: Path, server_urls: list[str], run_dir: Path, *,
               resume: bool = False, overrides: tuple[str, ...] = ()) -> list[str]:
    """``oolong train`` arguments for a flow-started trainer: the prepared spec (or the run
    directory on resume), the run's servers, status reported by the flow."""
    source = ["--resume", str(run_dir)] if resume else ["--config", str(spec_path)]
    return ["train", "--no-progress", *source,
            f"rollout.server_urls=[{','.join(server_urls)}]", "metrics.report_status=false",
            *overrides]


def trainer_command(spec_path: Path, server_urls: list[str], run_dir: Path, *, nproc: int = 1,
                    nnodes: int = 1, node_rank: int = 0, master: tuple[str, int] | None = None,
                    resume: bool = False, overrides: tuple[str, ...] = ()) -> list[str]:
    """The trainer on one node: ``nproc`` ranks (one per GPU it owns) of ``torch.distributed.run``,
    standalone on one node or joining ``master`` (rank 0's node) with ``nnodes`` nodes. One
    process on one node runs directly: no launcher, and the flow sees the trainer's own exit
    status (e.g. killed by SIGKILL)."""
    args = train_args(spec_path, server_urls, run_dir, resume=resume, overrides=overrides)
    if nproc == 1 and nnodes == 1:
        return [sys.executable, "-m", "training_core.cli", *args]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    if nnodes == 1:
        cmd.append("--standalone")
    else:
        if master is None:
            raise ValueError("a trainer on several nodes needs the rendezvous address (master)")
        cmd += ["--nnodes", str(nnodes), "--node_rank", str(node_rank), "--master_addr",
                master[0], "--master_port", str(master[1])]
    return [*cmd, "--module", "training_core.cli", *args]


def server_process(name: str, cmd: list[str], url: str, log: Path,
                   env: dict[str, str] | None = None) -> ManagedProcess:
    return ManagedProcess(name, cmd, log, env=env, health_url=url + "/health")


def start_embedded_fleet(model_path: str, n: int, log_dir: str | Path, *, threads: int = 1,
                         max_batch_size: int = 256, seed: int = 0, weight_version: int = 0,
                         host: str = "127.0.0.1", dtype: str = "float32") -> Fleet:
    log_dir = Path(log_dir)
    env = process_env({"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"})
    fleet = Fleet(urls=[])
    for i in range(n):
        port = free_port()
        url = f"http://{host}:{port}"
        cmd = embedded_server_command(model_path, port, host=host, threads=threads,
                                      max_batch_size=max_batch_size, seed=seed + i,
                                      weight_version=weight_version, parent_pid=os.getpid(),
                                      dtype=dtype)
        fleet.urls.append(url)
        fleet.servers.append(
            server_process(f"rollout server {i}", cmd, url, log_dir / f"rollout-server-{i}.log",
                           env).start())
    try:
        fleet.wait_healthy()
    except BaseException:
        fleet.stop()
        raise
    return fleet
