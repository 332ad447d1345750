"""Start and stop rollout servers as processes (embedded or SGLang), and build their commands.

Used by ``oolong train`` on one machine and by the orchestration flows on GPU nodes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from training_core.http import wait_healthy


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


@dataclass
class Fleet:
    urls: list[str]
    processes: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        for url, proc, log in zip(self.urls, self.processes or [None] * len(self.urls),
                                  self.logs or [None] * len(self.urls), strict=False):

            def dead(url=url, proc=proc, log=log) -> str | None:
                if proc is None or proc.poll() is None:
                    return None
                tail = log.read_text()[-2000:] if log and log.exists() else ""
                return f"rollout server {url} exited with {proc.returncode}:\n{tail}"

            try:
                wait_healthy(url + "/health", max(deadline - time.monotonic(), 0.0), dead=dead)
            except TimeoutError:
                raise TimeoutError(f"rollout server {url} not healthy after {timeout_s:.0f}s") from None

    def alive(self) -> list[bool]:
        return [p.poll() is None for p in self.processes]

    def stop(self, grace_s: float = 10.0) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.processes:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_embedded_fleet(model_path: str, n: int, log_dir: str | Path, *, threads: int = 1,
                         max_batch_size: int = 256, seed: int = 0, weight_version: int = 0) -> Fleet:
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    fleet = Fleet(urls=[])
    for i in range(n):
        port = free_port()
        log = log_dir / f"rollout-server-{i}.log"
        proc = subprocess.Popen(
            embedded_server_command(model_path, port, threads=threads,
                                    max_batch_size=max_batch_size, seed=seed + i,
                                    weight_version=weight_version, parent_pid=os.getpid()),
            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        fleet.urls.append(f"http://127.0.0.1:{port}")
        fleet.processes.append(proc)
        fleet.logs.append(log)
    try:
        fleet.wait_healthy()
    except BaseException:
        fleet.stop()
        raise
    return fleet
