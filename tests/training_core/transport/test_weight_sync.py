"""Weights over the network: SGLang's distributed weight update between a real trainer and real
embedded servers (separate processes, gloo), and the request bodies against SGLang's models."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from tests.training_core.conftest import start_server
from tests.training_core.scripted_http import ScriptedServer
from tests.training_core.sglang_contract import check_request
from training_core.api import RolloutServerError
from training_core.transport.rollout_client import RolloutClient
from training_core.transport.weight_sync import DistributedSync, push_weights
from training_core.version import PolicyVersion


@pytest.fixture(scope="module")
def two_servers(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("servers")
    fleets = [start_server(tiny_model_dir, logs / f"s{i}.log", seed=i) for i in range(2)]
    yield [url for _, url in fleets]
    for fleet, _ in fleets:
        fleet.stop()


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    from training_core.trainer.deepspeed_trainer import DeepSpeedTrainer

    return DeepSpeedTrainer(tiny_model_dir, lr=1e-3, weight_decay=0.0, grad_clip=1.0,
                            zero_stage=0)


def _server_weights(url: str, names: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        r = httpx.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": 1 << 20},
                       timeout=30)
        r.raise_for_status()
        out[name] = torch.tensor(r.json(), dtype=torch.float32)
    return out


async def _sync(urls: list[str], sync: DistributedSync, version: int) -> None:
    policy = PolicyVersion(version - 1)  # a trainer about to push ``version``
    client = RolloutClient(urls, version=policy)
    try:
        await sync.connect(client)
        assert await push_weights(client, sync, policy) == version == policy.current
        await sync.close(client)
    finally:
        await client.aclose()


@pytest.mark.parametrize(("bucket_bytes", "flatten", "version"), [
    (1 << 30, True, 7),  # one flat buffer for everything (the default way)
    (1, False, 8),  # one tensor per bucket and per broadcast (SGLang's plain form)
    (200_000, True, 9),  # several flat buckets
])
def test_weights_arrive_bit_identical_on_every_server(trainer, two_servers, bucket_bytes, flatten,
                                                      version):
    with torch.no_grad():  # weights no server has: the initial ones plus a seeded perturbation
        gen = torch.Generator().manual_seed(version)
        for p in trainer.engine.module.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)
    sent = {k: v.clone() for k, v in trainer.weights().items()}
    sync = DistributedSync(bucket_bytes=bucket_bytes, flatten=flatten)
    sync.export(trainer, version)
    assert len(sync._buckets) == {7: 1, 8: len(sent)}.get(version, len(sync._buckets))
    assert version != 9 or 1 < len(sync._buckets) < len(sent)

    asyncio.run(_sync(two_servers, sync, version))

    for url in two_servers:
        got = _server_weights(url, list(sent))
        for name, tensor in sent.items():
            assert torch.equal(got[name], tensor.float()), f"{url}: {name} differs"
        info = httpx.get(url + "/model_info").json()
        assert info["weight_version"] == str(version)
        # The servers generate with them (the tied head was re-tied to the new embeddings).
        out = httpx.post(url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
            "max_new_tokens": 3, "temperature": 0.0}}, timeout=60).json()
        assert out["meta_info"]["weight_version"] == str(version)


def test_a_push_without_a_group_fails_with_the_servers_reason(two_servers):
    async def go():
        client = RolloutClient(two_servers[:1])
        try:
            async with client.weight_update_session():  # as 0.5.23 wants a distributed load
                await client.update_weights_from_distributed(
                    names=["model.norm.weight"], dtypes=["float32"], shapes=[[4]],
                    group_name="never-made", version=1, flush_cache=True)
        finally:
            await client.aclose()

    with pytest.raises(RolloutServerError, match="never-made.*init_weights_update_group"):
        asyncio.run(go())


def test_weight_update_requests_match_sglangs_request_models(trainer):
    """The trainer's bodies, recorded at the transport, against SGLang's dataclasses; the
    servers answer as SGLang does, including a 404 for /begin_weight_update on versions
    without it."""
    seen: list[tuple[str, dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        seen.append((request.url.path, body))
        if request.url.path == "/server_info":
            return httpx.Response(200, json={"tp_size": 2})
        if request.url.path in ("/begin_weight_update", "/end_weight_update"):
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(200, json={"success": True, "message": "ok"})

    sync = DistributedSync()

    async def go():
        client = RolloutClient(["http://a:1", "http://b:1"], connect=ScriptedServer(handler))
        # The trainer's own join would wait for ranks that do not exist: record the HTTP side.
        await client.init_weights_update_group(
            master_address="127.0.0.1", master_port=1234, rank_offsets=[1, 3], world_size=5,
            group_name="g", backend="gloo")
        assert await client.tp_sizes() == [2, 2]
        async with client.weight_update_session():  # a release without it: nothing sent again
            pass
        async with client.weight_update_session():
            pass
        await client.update_weights_from_distributed(
            names=["x"], dtypes=["bfloat16"], shapes=[[2, 3]], group_name="g", version=3,
            flush_cache=True, load_format="flattened_bucket")
        await client.destroy_weights_update_group("g")
        await client.aclose()

    asyncio.run(go())
    assert sync.group is None
    offsets = [b["rank_offset"] for p, b in seen if p == "/init_weights_update_group"]
    assert offsets == [1, 3]
    for path, body in seen:
        if path in ("/server_info", "/begin_weight_update"):
            continue
        assert check_request("POST", path, body) == [], (path, body)


def test_a_restarted_server_gets_the_group_rebuilt_and_the_current_weights(
        trainer, tiny_model_dir, tmp_path):
    """A server restarted mid-run lost its group membership and serves its launch weights: the
    next push sees its older weight_version, rebuilds the group with every server, and sends."""
    fleets = [start_server(tiny_model_dir, tmp_path / f"s{i}.log", seed=i) for i in range(2)]
    urls = [url for _, url in fleets]
    sync = DistributedSync()
    policy = PolicyVersion()

    async def push(client, version):
        sync.export(trainer, version)
        assert await push_weights(client, sync, policy) == version

    async def go():
        client = RolloutClient(urls, version=policy)
        try:
            await sync.connect(client)
            await push(client, 1)
            first_group = sync.group
            fleets[1][0].restart(0, timeout_s=120)  # no bring-up: it starts at version 0
            assert await client.weight_versions() == ["1", "0"]
            with torch.no_grad():
                for p in trainer.engine.module.parameters():
                    p.mul_(1.01)
            await push(client, 2)
            assert sync.group is not first_group, "the group was rebuilt"
            await sync.close(client)
        finally:
            await client.aclose()

    try:
        asyncio.run(go())
        sent = {k: v.clone() for k, v in trainer.weights().items()}
        for url in urls:
            assert httpx.get(url + "/model_info").json()["weight_version"] == "2"
            got = _server_weights(url, list(sent))
            assert all(torch.equal(got[n], t.float()) for n, t in sent.items()), url
    finally:
        for fleet, _ in fleets:
            fleet.stop()


def test_an_adapter_is_sent_from_the_device_it_trains_on():
    """NCCL takes no CPU tensors: a LoRA run's adapter is bucketed where the trainer holds it
    (here the meta device stands for a GPU), never moved to the CPU to suit gloo, and the group's
    backend follows that device as for full weights."""
    adapter = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
               torch.empty(4, 16, device="meta"),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
               torch.empty(16, 4, device="meta")}

    class LoraTrainer:
        def adapter_weights(self):
            return adapter, {"r": 4, "lora_alpha": 8}

        def weights(self):
            raise AssertionError("a LoRA run must not send its full weights")

    sync = DistributedSync()
    sync.export(LoraTrainer(), 3)
    assert sync.device == torch.device("meta")
    assert sync._buckets[0].names == list(adapter)
    assert sync._buckets[0].tensors[0].numel() == 2 * 4 * 16 * 4  # the two fp32 tensors' bytes
