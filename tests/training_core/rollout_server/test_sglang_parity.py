"""The embedded server answers as the pinned SGLang release does, checked against the release's
own code (sglang_oracle.py) wherever the two could train on different data: the contract gate,
sampling parameters (the greedy threshold, the range checks), the context length, stopping,
auth, the weight-update session and the per-token weight versions."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

from tests.training_core.conftest import generate, start_server
from tests.training_core.sglang_contract import release_source_or_skip
from tests.training_core.sglang_oracle import Release
from training_core.rollout_server import requests as rules
from training_core.rollout_server.generation_engine import version_meta
from training_core.rollout_server.server import allowed


@pytest.fixture(scope="module")
def release() -> Release:
    return Release(release_source_or_skip())


def _post(url: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=120, **kw)


def test_unknown_keys_are_treated_as_the_releases_contract_gate_treats_them(server, release):
    # top level: ignored by the release, ignored here
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}, "not_a_field": 1}
    assert release.contract_error(body) is None
    assert _post(server, body).status_code == 200
    # in sampling_params: refused by the release, refused here with its words
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "temprature": 0.5}}
    expected = release.contract_error(body)
    resp = _post(server, body)
    assert expected is not None and resp.status_code == 400
    assert resp.json()["error"] == expected


# lora_path is served since issue 49 (test_embedded_lora.py)
@pytest.mark.parametrize("field, value", [("logprob_start_len", 0),
                                          ("top_logprobs_num", 3), ("return_hidden_states", True),
                                          ("session_params", {"id": "s"})])
def test_release_fields_the_embedded_server_cannot_honour_are_refused_naming_them(
        server, release, field, value):
    """The release takes them (they change what it generates or returns); the embedded server
    accepted and ignored them, answering from the base weights or with other logprobs."""
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}, field: value}
    assert release.contract_error(body) is None
    resp = _post(server, body)
    assert resp.status_code == 400 and field in resp.json()["error"]["message"]
    # harmless ones (routing, labels) are taken
    assert _post(server, {**body, field: None, "routing_key": "k"}).status_code == 200


@pytest.mark.parametrize("params", [{"temperature": -1.0}, {"temperature": float("nan")},
                                    {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 0},
                                    {"top_k": -5}, {"max_new_tokens": -1}])
def test_bad_sampling_parameters_are_refused_with_the_releases_message(server, release, params):
    with pytest.raises(ValueError) as theirs:
        release.sampling_params(**params)
    resp = httpx.post(server + "/generate", content=json.dumps(
        {"input_ids": [5, 6], "sampling_params": params}, allow_nan=True),
        headers={"content-type": "application/json"}, timeout=60)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == str(theirs.value)


def test_a_temperature_below_the_releases_epsilon_is_greedy(server, release):
    """0 < T < 1e-6 was sampled at that temperature here; SGLang samples greedily (T = 1, top_k
    = 1), so the tokens and their logprobs are those of the greedy request."""
    sp = release.sampling_params(temperature=5e-7)
    assert (sp.temperature, sp.top_k) == (1.0, 1)
    tiny = generate(server, [7, 8, 9], max_new_tokens=12, temperature=5e-7)
    greedy = generate(server, [7, 8, 9], max_new_tokens=12, temperature=0.0)
    assert tiny["output_ids"] == greedy["output_ids"]
    assert tiny["meta_info"]["output_token_logprobs"] == greedy["meta_info"]["output_token_logprobs"]


def test_a_request_over_the_context_is_what_the_release_makes_of_it(server, release):
    """A 400 in SGLang's words, or the budget SGLang's scheduler runs it with (the prompt is never
    trimmed): the tokenizer manager's checks, then the scheduler's, each its own code."""
    info = httpx.get(server + "/server_info", timeout=30).json()
    context = info["context_length"]
    assert info["max_req_input_len"] == context - 6  # what SGLang reports, and the client reads
    cases = [(context - 12, 6), (context - 12, 10), (context - 12, 11), (context - 6, 1),
             (context - 4, 4), (context - 4, 5), (context, 1), (context + 3, 0)]
    for prompt, new in cases:
        expected = release.admitted(prompt, new, context)
        resp = _post(server, {"input_ids": [5] * prompt, "sampling_params": {
            "max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}})
        if isinstance(expected, int):
            assert resp.status_code == 200, (prompt, new, resp.text)
            assert len(resp.json()["output_ids"]) == expected
        else:
            assert resp.status_code == 400, (prompt, new)
            assert resp.json()["error"]["message"] == expected
    assert release.admitted(context - 12, 11, context) == 10  # the release cuts this one


def test_ignore_eos_turns_off_stop_token_ids_too(server):
    first = generate(server, [7, 8, 9], max_new_tokens=6, temperature=0.0)["output_ids"]
    at = max(i for i, t in enumerate(first) if t not in first[:i])  # its first occurrence
    stop = first[at]
    stopped = generate(server, [7, 8, 9], max_new_tokens=6, temperature=0.0, stop_token_ids=[stop])
    assert stopped["output_ids"] == first[:at + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    ignored = generate(server, [7, 8, 9], max_new_tokens=6, temperature=0.0,
                       stop_token_ids=[stop], ignore_eos=True)
    assert ignored["output_ids"] == first
    assert ignored["meta_info"]["finish_reason"]["type"] == "length"


def test_the_stop_ids_are_the_configs_eos_ids_as_sglang_started_without_its_tokenizer(
        tiny_model_dir, tmp_path):
    """SGLang is launched with --skip-tokenizer-init: it stops on config.json's and
    generation_config.json's eos_token_id, never on the tokenizer's own."""
    from training_core.rollout_server.generation_engine import GenerationEngine

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["eos_token_id"] = 11
    (model / "config.json").write_text(json.dumps(config))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [12, 13]}))
    engine = GenerationEngine(str(model))
    try:
        tokenizer_eos = engine.tokenizer.eos_token_id
        assert engine.eos_ids == {11, 12, 13}
        assert tokenizer_eos not in engine.eos_ids or tokenizer_eos in (11, 12, 13)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("method, path, header", [
    ("POST", "/generate", None), ("POST", "/generate", "Bearer k3y"),
    ("POST", "/generate", "Bearer wrong"), ("POST", "/generate", "Basic k3y"),
    ("POST", "/update_weights_from_disk", None), ("POST", "/update_weights_from_disk", "bearer k3y"),
    ("GET", "/health", None), ("GET", "/health_generate", None), ("GET", "/model_info", None),
    ("OPTIONS", "/generate", None), ("GET", "/metrics", None)])
@pytest.mark.parametrize("level", ["normal", "admin_optional"])
def test_auth_decides_as_the_releases_decide_request_auth(release, method, path, header, level):
    for key in ("k3y", None):
        assert allowed(method, path, header, key) == release.allowed(method, path, header, key,
                                                                    level)


def test_a_server_with_a_key_answers_only_requests_that_carry_it(tiny_model_dir, tmp_path,
                                                                  monkeypatch):
    """Issue 47's attack: with no credential a stranger read the weights, loaded others under a
    forged version and paused generation. Now every route but the health probes wants the run's
    key, and weights load only from the run's weights folder."""
    monkeypatch.setenv("OOLONG_SERVER_KEY", "k3y")
    weights = tmp_path / "weights"
    weights.mkdir()
    fleet, url = start_server(tiny_model_dir, tmp_path / "s.log",
                              extra=["--weights-root", str(weights)])
    try:
        stranger = {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}
        for path, body in [("/generate", stranger), ("/pause_generation", {}),
                           ("/get_weights_by_name", {"name": "lm_head.weight"}),
                           ("/init_weights_update_group", {"master_address": "10.0.0.9",
                                                           "master_port": 1, "rank_offset": 1,
                                                           "world_size": 2})]:
            assert httpx.post(url + path, json=body, timeout=30).status_code == 401, path
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        auth = {"Authorization": "Bearer k3y"}
        assert httpx.post(url + "/generate", json=stranger, headers=auth, timeout=60).status_code == 200
        outside = httpx.post(url + "/update_weights_from_disk", headers=auth, timeout=60,
                             json={"model_path": str(tiny_model_dir), "weight_version": "999"})
        assert outside.status_code == 400 and "weights root" in outside.json()["message"]
        info = httpx.get(url + "/model_info", headers=auth, timeout=30).json()
        assert info["weight_version"] == "0"
    finally:
        fleet.stop()


def test_the_weight_update_session_is_the_releases(server):
    begin = httpx.post(server + "/begin_weight_update", json={}, timeout=30)
    assert begin.status_code == 200 and begin.json()["success"]
    again = httpx.post(server + "/begin_weight_update", json={}, timeout=30)
    assert again.status_code == 400
    assert again.json()["message"] == ("a weight-update session is already open; call "
                                       "end_weight_update() first")
    assert httpx.post(server + "/end_weight_update", json={}, timeout=30).status_code == 200
    end = httpx.post(server + "/end_weight_update", json={}, timeout=30)
    assert end.status_code == 400 and "no weight-update session is open" in end.json()["message"]


def test_a_failed_push_still_ends_the_session(server, tiny_model_dir):
    """A distributed push that failed between begin and end left the session open, and 0.5.23
    refuses every later begin: one failed push broke every later one."""
    from training_core.transport.rollout_client import RolloutClient

    class Broken(Exception):
        pass

    async def go() -> None:
        client = RolloutClient([server])
        try:
            with pytest.raises(Broken):
                async with client.weight_update_session():
                    raise Broken  # the broadcast failed
            async with client.weight_update_session():  # the next push can begin
                pass
        finally:
            await client.aclose()

    asyncio.run(go())
    assert httpx.post(server + "/end_weight_update", json={}, timeout=30).status_code == 400


@pytest.mark.parametrize("events, current, tokens", [
    ([], "0", 5), ([], "3", 0), ([("0", 3)], "1", 5), ([("0", 3), ("1", 3)], "2", 6),
    ([("0", 2), ("1", 4)], "2", 4), ([("0", 0)], "1", 3), ([("0", 5)], "1", 5),
    ([("0", 2), ("0", 4)], "1", 6)])
def test_weight_version_spans_are_the_releases(release, events, current, tokens):
    assert version_meta(events, current, tokens) == release.version_meta(events, current, tokens)


def test_the_release_rules_tables_match_its_sampling_fields(release):
    """requests.py's list of SGLang's sampling fields is the release's, in its order."""
    fields = release.api.SamplingParams.__struct_fields__
    assert rules.SGLANG_SAMPLING_FIELDS == fields
    generate_fields = set(release.api.GenerateRequest.__struct_fields__)
    ours = ({"text", "input_ids", "sampling_params", "return_logprob", "rid", "stream",
             "lora_path"}
            | rules.UNSUPPORTED_GENERATE_DEFAULTS.keys() | rules.IGNORED_GENERATE_FIELDS)
    assert ours == generate_fields


def test_distributed_weights_load_only_inside_a_session_and_a_stale_one_is_closed(server):
    """0.5.23 refuses /update_weights_from_distributed outside begin/end (so a client that does
    not bracket a push gets nothing loaded); a session a dead trainer left open is closed by the
    next trainer's begin instead of failing every push."""
    from training_core.transport.rollout_client import RolloutClient

    outside = httpx.post(server + "/update_weights_from_distributed", timeout=30, json={
        "names": ["x"], "dtypes": ["float32"], "shapes": [[1]]})
    assert outside.status_code == 400 and "between begin_weight_update()" in outside.text
    assert httpx.post(server + "/begin_weight_update", json={}, timeout=30).status_code == 200

    async def go() -> None:
        client = RolloutClient([server])
        try:
            async with client.weight_update_session():
                again = httpx.post(server + "/begin_weight_update", json={}, timeout=30)
                assert again.status_code == 400  # open: this trainer's session
        finally:
            await client.aclose()

    asyncio.run(go())
    assert httpx.post(server + "/end_weight_update", json={}, timeout=30).status_code == 400
