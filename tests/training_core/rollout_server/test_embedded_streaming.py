"""The embedded server streams like SGLang's ``stream: true`` and keeps a prefix cache across
requests (issue 51.6-7): a request that extends a finished one prefills only its new tokens,
and generates what a full prefill would."""

from __future__ import annotations

import json

import httpx

from tests.training_core.conftest import generate


def _stream(url: str, input_ids: list[int], **sampling) -> list:
    events = []
    with httpx.stream("POST", url + "/generate", timeout=120, json={
            "input_ids": input_ids, "sampling_params": sampling, "return_logprob": True,
            "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return events


def _info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=30).json()


def test_a_streamed_generation_sends_every_token_as_it_is_sampled(server):
    prompt = [5, 6, 7, 8]
    events = _stream(server, prompt, max_new_tokens=12, temperature=0.0, ignore_eos=True)
    assert events[-1] == "[DONE]"
    items = events[:-1]
    whole = generate(server, prompt, max_new_tokens=12, temperature=0.0, ignore_eos=True)
    assert items[-1]["output_ids"] == whole["output_ids"]  # the same greedy answer
    assert items[-1]["meta_info"]["finish_reason"]["type"] == "length"
    # One event per token before the last, each with everything so far (SGLang's default).
    partial = items[:-1]
    assert [len(e["output_ids"]) for e in partial] == list(range(1, 13))
    assert all(e["meta_info"]["finish_reason"] is None for e in partial)
    assert all(len(e["meta_info"]["output_token_logprobs"]) == len(e["output_ids"]) for e in partial)


def test_a_client_that_goes_away_stops_its_generation(server):
    with httpx.stream("POST", server + "/generate", timeout=120, json={
            "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
            "stream": True}) as resp:
        lines = resp.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    # Aborted in the engine: nothing keeps generating for a client that is gone.
    for _ in range(200):
        if _info(server)["running"] == 0:
            break
        httpx.post(server + "/flush_cache")  # a cheap request while waiting
    assert _info(server)["running"] == 0


def test_a_turn_that_extends_a_finished_request_prefills_only_its_new_tokens(server):
    first_prompt = list(range(10, 50))
    first = generate(server, first_prompt, max_new_tokens=10, temperature=0.0, ignore_eos=True)
    turn = first_prompt + first["output_ids"] + [20, 21, 22, 23, 24]  # the next turn's prompt
    before = _info(server)
    second = generate(server, turn, max_new_tokens=8, temperature=0.0, ignore_eos=True)
    after = _info(server)
    # Cached: the first request's prompt and output but its last token (never fed to the model).
    cached = len(first_prompt) + len(first["output_ids"]) - 1
    assert after["cached_tokens"] - before["cached_tokens"] == cached
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(turn) - cached == 6
    # The same answer and logprobs as a full prefill.
    flushed = httpx.post(server + "/flush_cache")  # SGLang answers in plain text
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed")
    full = generate(server, turn, max_new_tokens=8, temperature=0.0, ignore_eos=True)
    assert _info(server)["prefill_tokens"] - after["prefill_tokens"] == len(turn)
    assert full["output_ids"] == second["output_ids"]
    for (a, _, _), (b, _, _) in zip(full["meta_info"]["output_token_logprobs"],
                                    second["meta_info"]["output_token_logprobs"], strict=True):
        assert abs(a - b) < 1e-3


def test_a_session_sticks_to_its_server():
    from training_core.transport.rollout_client import RolloutClient

    client = RolloutClient(["http://a:1", "http://b:1", "http://c:1"])
    first = client._pick("session-1")
    first.in_flight += 5  # busier now: a new session goes elsewhere, this one stays
    assert all(client._pick("session-1") is first for _ in range(5))
    assert client._pick("session-2") is not first
    first.down_until = float("inf")  # its server fails: the session moves, and stays moved
    moved = client._pick("session-1")
    assert moved is not first and client._pick("session-1") is moved
