"""LoRA on the embedded server (issue 49.2): SGLang 0.5.23's routes with its request fields,
``lora_path`` per request, the adapter merged into the served weights, SGLang's 400 for an
adapter that is not loaded; and the rollout client's adapter lifecycle against it."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from tests.training_core.conftest import start_server
from tests.training_core.sglang_contract import (
    MODELS,
    check_request,
    release_models,
    release_source_or_skip,
)
from training_core.api import GenerationRequest, SamplingParams
from training_core.config import LoraSpec
from training_core.models.loading import load_model
from training_core.prefix_tree import sequence_logprobs
from training_core.rollout_server import requests as rules
from training_core.trainer import adapter
from training_core.transport.rollout_client import RolloutClient
from training_core.transport.weight_sync import DistributedSync, push_weights
from training_core.version import PolicyVersion

PROMPT = [20, 21, 22, 23]


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, tmp_path_factory):
    fleet, url = start_server(tiny_model_dir, tmp_path_factory.mktemp("lora") / "server.log")
    yield url
    fleet.stop()


def _adapter(model_dir, folder, seed: int):
    """A peft adapter whose B is not zero (a fresh one would change nothing), saved in peft's
    layout as the trainer saves it, and the peft model for reference logprobs."""
    torch.manual_seed(seed)
    model = adapter.wrap(load_model(model_dir, "float32"), LoraSpec(rank=4, alpha=8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.2)
    adapter.save(model, folder)
    return model.eval()


def _generate(url: str, **extra) -> httpx.Response:
    return httpx.post(url + "/generate", json={
        "input_ids": PROMPT, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True},
        **extra}, timeout=120)


def _logprobs_under(model, out: dict) -> torch.Tensor:
    ids = torch.tensor([PROMPT + out["output_ids"]])
    with torch.no_grad():
        return sequence_logprobs(model, ids, torch.ones_like(ids), 1.0)[0, len(PROMPT):]


def _served(out: dict) -> torch.Tensor:
    return torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])


def test_a_loaded_adapter_serves_the_peft_models_distribution_and_unloading_restores_the_base(
        lora_server, tiny_model_dir, tmp_path):
    base = _generate(lora_server).json()
    peft_model = _adapter(tiny_model_dir, tmp_path / "a1", seed=1)

    r = httpx.post(lora_server + "/load_lora_adapter",
                   json={"lora_name": "a1", "lora_path": str(tmp_path / "a1")})
    assert r.status_code == 200, r.text
    assert r.json()["success"] and r.json()["loaded_adapters"] == {"a1": str(tmp_path / "a1")}
    served = _generate(lora_server, lora_path="a1").json()
    # the served logprobs are peft's own model's (adapter merged: float sums in another order)
    assert torch.allclose(_served(served), _logprobs_under(peft_model, served), atol=1e-4)
    assert not torch.allclose(_served(served), _served(base), atol=1e-3), "the adapter changed it"
    # per-row names (SGLang's list form) are checked the same way
    two = httpx.post(lora_server + "/generate", json={
        "input_ids": [PROMPT, PROMPT], "lora_path": ["a1", None], "return_logprob": True,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}, timeout=120)
    assert two.status_code == 200, two.text

    again = httpx.post(lora_server + "/load_lora_adapter",
                       json={"lora_name": "a1", "lora_path": str(tmp_path / "a1")})
    assert again.status_code == 400 and "already loaded" in again.json()["error_message"]

    r = httpx.post(lora_server + "/unload_lora_adapter", json={"lora_name": "a1"})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {}
    restored = _generate(lora_server).json()
    assert restored["output_ids"] == base["output_ids"]
    assert torch.equal(_served(restored), _served(base))
    gone = _generate(lora_server, lora_path="a1")
    assert gone.status_code == 400
    assert gone.json()["error"]["message"].startswith(
        "The following requested LoRA adapters are not loaded: a1")


def test_unknown_adapters_and_bad_folders_are_400s_in_sglangs_words(lora_server, tmp_path):
    resp = _generate(lora_server, lora_path="never")
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert message == ("Got LoRA adapter that has never been loaded: never\n"
                       "All loaded adapters: dict_keys([]).")
    r = httpx.post(lora_server + "/unload_lora_adapter", json={"lora_name": "never"})
    assert r.status_code == 400 and r.json() == {
        "success": False, "loaded_adapters": {},
        "error_message": "LoRA with name never does not exist. Loaded LoRAs: dict_keys([])"}
    r = httpx.post(lora_server + "/load_lora_adapter",
                   json={"lora_name": "x", "lora_path": str(tmp_path / "nothing")})
    assert r.status_code == 400 and "no peft adapter" in r.json()["error_message"]
    r = httpx.post(lora_server + "/load_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400 and "lora_path" in r.json()["message"]


def test_the_messages_are_the_releases():
    """The refusals above are the pinned release's own strings."""
    root = release_source_or_skip()
    tm = (root / "sglang/srt/managers/tokenizer_manager.py").read_text()
    assert 'f"Got LoRA adapter that has never been loaded: {lora_path}\\n"' in tm
    assert 'f"All loaded adapters: {self.lora_ref_cache.keys()}."' in tm
    registry = (root / "sglang/srt/lora/lora_registry.py").read_text()
    assert 'f"LoRA with name {lora_name} does not exist. Loaded LoRAs: {self._registry.keys()}"' \
        in registry
    assert 'f"The following requested LoRA adapters are not loaded: {name}\\n"' in registry


@pytest.mark.parametrize("ours, theirs", [
    (rules.LoadLoRAAdapterReqIn, "LoadLoRAAdapterReqInput"),
    (rules.LoadLoRAAdapterFromTensorsReqIn, "LoadLoRAAdapterFromTensorsReqInput"),
    (rules.UnloadLoRAAdapterReqIn, "UnloadLoRAAdapterReqInput"),
    (rules.UpdateWeightVersionReqIn, "UpdateWeightVersionReqInput"),
])
def test_the_lora_request_models_have_the_releases_fields(ours, theirs):
    """Our models take the release's field names, required where it requires them (the contract
    fixture, itself checked against the wheel in test_sglang_contract)."""
    fixture = MODELS[theirs]
    assert set(ours.model_fields) <= set(fixture["fields"])
    required = {n for n, f in ours.model_fields.items() if f.is_required()}
    assert required == set(fixture["required"])
    root = release_source_or_skip()
    real = release_models(root)[theirs]
    assert set(ours.model_fields) <= set(real)
    assert required == {f for f, has_default in real.items() if not has_default}


def test_the_client_names_the_current_adapter_and_unloads_the_idle_ones(
        lora_server, tiny_model_dir, tmp_path):
    models = {v: _adapter(tiny_model_dir, tmp_path / f"v{v}", seed=v) for v in (1, 2, 3)}

    async def go():
        client = RolloutClient([lora_server], api_key="")
        req = GenerationRequest(PROMPT, SamplingParams(max_new_tokens=6, temperature=1.0))
        await client.load_lora_adapter("v1", str(tmp_path / "v1"), 1)
        client.policy.advance()
        out = await client.agenerate(req)
        # served by adapter v1: its logprobs, and its version on every token
        ids = torch.tensor([PROMPT + out.output_ids])
        with torch.no_grad():
            want = sequence_logprobs(models[1], ids, torch.ones_like(ids), 1.0)[0, len(PROMPT):]
        assert torch.allclose(torch.tensor(out.output_logprobs), want, atol=1e-4)
        assert out.output_versions == [1] * len(out.output_ids)
        # a request still naming v1 keeps it loaded through the next push
        with client.adapter_in_use() as name:
            assert name == "v1"
            await client.load_lora_adapter("v2", str(tmp_path / "v2"), 2)
            assert await client.unload_unused_adapters() == []
        await client.load_lora_adapter("v3", str(tmp_path / "v3"), 3)
        assert await client.unload_unused_adapters() == ["v1", "v2"]
        assert client.loaded_adapters == ["v3"] and client.lora_name == "v3"
        info = httpx.get(lora_server + "/model_info").json()
        assert info["weight_version"] == "3"
        r = await client._post(client.servers[0], "/unload_lora_adapter", {"lora_name": "v3"})
        assert r["loaded_adapters"] == {}
        await client.aclose()

    asyncio.run(go())


def test_an_adapter_over_the_weight_group_is_served_by_name(lora_server, tiny_model_dir,
                                                            tmp_path, monkeypatch):
    """weight_sync distributed with an adapter: its tensors alone over the group (gloo), then
    ``/load_lora_adapter_from_tensors`` with its config and no tensors in the body (SGLang's
    request model); the server serves the peft model's distribution under ``v<version>``."""
    peft_model = _adapter(tiny_model_dir, tmp_path / "g", seed=5)
    tensors, config = adapter.state(peft_model)
    bodies = []
    real_post = RolloutClient._post

    async def post(self, server, path, payload=None):
        bodies.append((path, payload))
        return await real_post(self, server, path, payload)

    monkeypatch.setattr(RolloutClient, "_post", post)

    class LoraTrainer:  # what the weight sync asks of a LoRA run's trainer
        def adapter_weights(self):
            return tensors, config

    async def go():
        policy = PolicyVersion(4)
        client = RolloutClient([lora_server], version=policy, api_key="")
        sync = DistributedSync()
        sync.export(LoraTrainer(), 5)
        await sync.connect(client)
        assert await push_weights(client, sync, policy) == 5
        await sync.close(client)
        await client.aclose()
        return sync.pushed_bytes

    before = httpx.get(lora_server + "/server_info").json()["weight_group_bytes_received"]
    pushed = asyncio.run(go())
    assert pushed == sum(t.numel() * t.element_size() for t in tensors.values())
    info = httpx.get(lora_server + "/server_info").json()
    assert info["weight_group_bytes_received"] - before == pushed
    assert info["weight_version"] == "5"
    served = _generate(lora_server, lora_path="v5").json()
    assert torch.allclose(_served(served), _logprobs_under(peft_model, served), atol=1e-4)
    for path, body in bodies:  # every body the release's request models take
        if body is not None:  # (the bodiless pause/continue calls are not this test's)
            assert check_request("POST", path, body) == [], (path, body)
    announced = [b for p, b in bodies if p == "/update_weights_from_distributed"]
    assert announced and all(".lora_" in n for b in announced for n in b["names"])
    loads = [b for p, b in bodies if p == "/load_lora_adapter_from_tensors"]
    assert loads == [{"lora_name": "v5", "config_dict": config, "serialized_named_tensors": []}]
    r = httpx.post(lora_server + "/unload_lora_adapter", json={"lora_name": "v5"})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {}


def test_tensors_in_the_request_or_none_received_are_400s(lora_server):
    r = httpx.post(lora_server + "/load_lora_adapter_from_tensors", json={
        "lora_name": "t", "config_dict": {"r": 4}, "serialized_named_tensors": ["gASV"]})
    assert r.status_code == 400 and "serialized_named_tensors" in r.json()["error_message"]
    assert "weight update group" in r.json()["error_message"]
    r = httpx.post(lora_server + "/load_lora_adapter_from_tensors", json={
        "lora_name": "t", "config_dict": {"r": 4}, "serialized_named_tensors": []})
    assert r.status_code == 400 and "no adapter tensors came" in r.json()["error_message"]
