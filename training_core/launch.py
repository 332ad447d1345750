"""Rollout server commands (embedded or SGLang) and the embedded fleet of ``oolong train``.
Their lifecycle (spawn, health, restart, stop) is ``training_core/processes.py``."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from training_core.processes import Fleet, ManagedProcess, process_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def embedded_server_command(model_path: str, port: int, *, host: str = "127.0.0.1",
                            threads: int = 1, max_batch_size: int = 256, seed: int = 0,
                            weight_version: int = 0, parent_pid: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "training_core.engines.embedded_server", "--model-path",
           str(model_path), "--host", host, "--port", str(port), "--threads", str(threads),
           "--max-batch-size", str(max_batch_size), "--seed", str(seed),
           "--weight-version", str(weight_version)]
    return cmd + (["--parent-pid", str(parent_pid)] if parent_pid else [])


def sglang_server_command(model_path: str, port: int, *, host: str = "0.0.0.0", tp: int = 1,
                          mem_fraction: float = 0.8, weight_version: int = 0,
                          extra: list[str] | None = None) -> list[str]:
    """The production rollout server. Flags per SGLang's server arguments; it starts at a known
    ``weight_version`` (the trainer checks it through ``/model_info``)."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
            "--host", host, "--port", str(port), "--tp-size", str(tp),
            "--mem-fraction-static", str(mem_fraction), "--skip-tokenizer-init",
            "--weight-version", str(weight_version), *(extra or [])]


def server_process(name: str, cmd: list[str], url: str, log: Path,
                   env: dict[str, str] | None = None) -> ManagedProcess:
    return ManagedProcess(name, cmd, log, env=env, health_url=url + "/health")


def start_embedded_fleet(model_path: str, n: int, log_dir: str | Path, *, threads: int = 1,
                         max_batch_size: int = 256, seed: int = 0, weight_version: int = 0,
                         host: str = "127.0.0.1") -> Fleet:
    log_dir = Path(log_dir)
    env = process_env({"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"})
    fleet = Fleet(urls=[])
    for i in range(n):
        port = free_port()
        url = f"http://{host}:{port}"
        cmd = embedded_server_command(model_path, port, host=host, threads=threads,
                                      max_batch_size=max_batch_size, seed=seed + i,
                                      weight_version=weight_version, parent_pid=os.getpid())
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
