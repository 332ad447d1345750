from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest

from training_core.launch import embedded_server_command, server_process
from training_core.ports import free_port
from training_core.processes import Fleet


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """A fresh (untrained) tiny Llama + character tokenizer, built locally and cached."""
    from training_core.models.paths import resolve_model_dir

    return resolve_model_dir("tiny")


def start_server(model_dir: Path, log_path: Path, seed: int = 0,
                 extra: list[str] | None = None) -> tuple[Fleet, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = server_process("test server", embedded_server_command(
        str(model_dir), port, seed=seed, parent_pid=os.getpid(), dtype="float32") + (extra or []),
        url, log_path, env={**os.environ, "OMP_NUM_THREADS": "1"}).start()
    fleet = Fleet(urls=[url], servers=[server])
    fleet.wait_healthy(120)
    return fleet, url


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    fleet, url = start_server(tiny_model_dir, tmp_path_factory.mktemp("server") / "server.log")
    yield url
    fleet.stop()


def generate(url: str, input_ids, **sampling) -> dict:
    sampling.setdefault("max_new_tokens", 16)
    resp = httpx.post(url + "/generate", json={"input_ids": input_ids, "sampling_params": sampling,
                                              "return_logprob": True}, timeout=120)
    resp.raise_for_status()
    return resp.json()


def run_episode(server: str, workflow, item: dict):
    """One episode of ``workflow`` against a real server, on a client of its own."""
    from training_core.transport.rollout_client import RolloutClient

    async def go():
        client = RolloutClient([server])
        try:
            return await workflow.arun_episode(client, item)
        finally:
            await client.aclose()

    return asyncio.run(go())
