"""The rollout client against a scripted SGLang at the HTTP level (its own HTTP/1.1 client over a
socket pair, scripted_http.ScriptedServer): which aborts
are interruptions, what is never retried, budgets and caps, and the wire contract with SGLang's
request models. The replies have SGLang's shape (``meta_info.finish_reason`` etc.)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.training_core.scripted_http import ScriptedServer
from tests.training_core.sglang_contract import check_request
from training_core.api import GenerationRequest, SamplingParams
from training_core.transport.rollout_client import (
    GenerationAborted,
    RequestRejected,
    RolloutClient,
)
from training_core.version import PolicyVersion

pytestmark = pytest.mark.unit  # no process, network or database (conftest)

URL = "http://127.0.0.2:30000"


def reply(ids, finish="stop", version="0", message=None):
    reason = {"type": finish}
    if message:
        reason.update(message=message, status_code=400)
    return {"text": "", "output_ids": ids, "meta_info": {
        "id": "r", "finish_reason": reason, "prompt_tokens": 3, "completion_tokens": len(ids),
        "output_token_logprobs": [[-0.5, t, None] for t in ids], "weight_version": version}}


class ScriptedSGLang:
    """Answers /generate from ``script(body, n_call)``; records every request."""

    def __init__(self, script):
        self.script = script
        self.requests: list[tuple[str, str, object]] = []
        self.generate_calls = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        if request.url.path == "/generate":
            self.generate_calls += 1
            status, payload = self.script(body, self.generate_calls)
            if asyncio.iscoroutine(payload):
                payload = await payload
            return httpx.Response(status, json=payload)
        if request.url.path == "/model_info":
            return httpx.Response(200, json={"weight_version": "0", "model_path": "m"})
        return httpx.Response(200, json={"success": True, "message": "ok"})


def client_for(server, **kw) -> RolloutClient:
    return RolloutClient([URL], connect=ScriptedServer(server), retry_window_s=0.5,
                         retries=1, **kw)


def run(coro):
    return asyncio.run(coro)


def request(max_new_tokens=4, ids=(1, 2, 3)):
    return GenerationRequest(list(ids), SamplingParams(max_new_tokens=max_new_tokens))


def test_abort_with_no_pause_is_an_episode_error_not_a_resubmit_loop():
    # SGLang answers abort with 0 tokens for a request it cannot serve (input too long).
    server = ScriptedSGLang(lambda body, n: (200, reply([], "abort", message="Input length (600 "
                                                        "tokens) exceeds the maximum")))
    client = client_for(server)
    with pytest.raises(GenerationAborted, match="exceeds the maximum"):
        run(client.agenerate(request()))
    assert server.generate_calls == 1  # before the fix: re-submitted forever


def test_http_4xx_is_never_retried():
    server = ScriptedSGLang(lambda body, n: (400, {"error": {"message": "bad top_k"}}))
    client = client_for(server)
    with pytest.raises(RequestRejected, match="400"):
        run(client.agenerate(request()))
    assert server.generate_calls == 1


def test_5xx_is_retried():
    server = ScriptedSGLang(lambda body, n: (503, {}) if n == 1 else (200, reply([7, 8])))
    client = client_for(server, cooldown_s=0.0)
    resp = run(client.agenerate(request()))
    assert resp.output_ids == [7, 8] and server.generate_calls == 2


async def until(condition, timeout_s: float = 5.0) -> None:
    """Wait on ``condition`` (polled on the loop), failing after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting on the condition"
        await asyncio.sleep(0.001)


async def start_then_pause(client, server, request_, paused: asyncio.Event) -> asyncio.Task:
    """Send a request, then pause the servers while it is in flight (the scripted server answers
    ``abort`` once ``paused`` is set, as SGLang does for requests a pause interrupts)."""
    task = asyncio.create_task(client.agenerate(request_))
    await until(lambda: server.generate_calls >= 1)  # on the server: in flight
    await client.pause()
    paused.set()
    return task


async def aborted_once(paused: asyncio.Event, ids, **kw):
    await paused.wait()  # in flight until the trainer pauses the server
    return reply(ids, "abort", **kw)


def test_abort_during_a_pause_resumes_with_the_partial_output_after_continue():
    async def scenario():
        paused = asyncio.Event()

        def script(body, n):
            if n == 1:
                return 200, aborted_once(paused, [10, 11], version="0")
            return 200, reply([12, 13], "length", version="1")

        server = ScriptedSGLang(script)
        client = client_for(server)
        task = await start_then_pause(client, server, request(max_new_tokens=4), paused)
        await asyncio.sleep(0.05)  # time to (wrongly) send it again: nothing to wait on
        # While paused, the interrupted sample waits: no second /generate yet.
        assert server.generate_calls == 1
        client.policy.advance()  # the trainer pushed version 1 meanwhile
        await client.resume()
        resp = await asyncio.wait_for(task, 5)
        second = [b for m, p, b in server.requests if p == "/generate"][1]
        return resp, second

    resp, second = run(scenario())
    assert resp.output_ids == [10, 11, 12, 13]
    assert resp.output_versions == [0, 0, 1, 1]
    assert resp.interruptions == 1 and resp.finish_reason == "length"
    # Re-submitted as prompt + partial output, with the remaining budget.
    assert second["input_ids"] == [1, 2, 3, 10, 11]
    assert second["sampling_params"]["max_new_tokens"] == 2


def test_in_place_pause_keeps_requests_on_the_server_and_labels_them_with_their_start():
    """pause_mode in_place: the pause says so, the weight update keeps the KV cache
    (flush_cache false), the request in flight is never sent again, and its tokens, generated on
    both sides of the update, all get the version it started with (the oldest)."""
    async def scenario():
        paused = asyncio.Event()

        async def finishes_after_the_update():
            await paused.wait()
            return reply([10, 11, 12, 13], "length", version="1")

        server = ScriptedSGLang(lambda body, n: (200, finishes_after_the_update()))
        client = client_for(server, pause_mode="in_place")
        task = asyncio.create_task(client.agenerate(request(max_new_tokens=4)))
        await until(lambda: server.generate_calls >= 1)  # on the server: in flight
        await client.pause()
        await client.update_weights_from_disk("/weights/v1", 1)
        await client.resume()
        paused.set()
        return await asyncio.wait_for(task, 5), server

    resp, server = run(scenario())
    assert server.generate_calls == 1 and resp.interruptions == 0
    assert resp.output_ids == [10, 11, 12, 13] and resp.output_versions == [0, 0, 0, 0]
    bodies = {path: body for _, path, body in server.requests}
    assert bodies["/pause_generation"] == {"mode": "in_place"}
    assert bodies["/update_weights_from_disk"]["flush_cache"] is False
    assert [p for m, path, b in server.requests for p in check_request(m, path, b)] == []


def test_abort_mode_leaves_flush_cache_to_the_server_default():
    server = ScriptedSGLang(lambda body, n: (200, reply([1])))
    run(client_for(server).update_weights_from_disk("/weights/v1", 1))
    assert "flush_cache" not in server.requests[0][2], "older SGLang releases lack the field"


def test_an_interruption_that_used_the_whole_budget_is_not_resubmitted():
    async def scenario():
        paused = asyncio.Event()
        server = ScriptedSGLang(lambda body, n: (200, aborted_once(paused, [1, 2, 3, 4])))
        client = client_for(server)
        task = await start_then_pause(client, server, request(max_new_tokens=4), paused)
        await asyncio.sleep(0.02)
        await client.resume()
        return await asyncio.wait_for(task, 5), server

    resp, server = run(scenario())
    assert resp.finish_reason == "length" and server.generate_calls == 1


def test_a_sample_interrupted_too_often_fails_its_episode():
    holder = {}

    def script(body, n):  # every request is cut short by a weight-update pause
        holder["client"]._pauses += 1
        return 200, reply([5], "abort")

    server = ScriptedSGLang(script)
    client = holder["client"] = client_for(server, max_interruptions=2)
    with pytest.raises(GenerationAborted, match="interrupted 3 times"):
        run(client.agenerate(request(max_new_tokens=50)))
    assert server.generate_calls == 3


def test_every_request_the_client_sends_matches_sglangs_request_models():
    server = ScriptedSGLang(lambda body, n: (200, [reply([1]), reply([2])]
                                             if isinstance(body["input_ids"][0], list) else reply([3])))
    client = client_for(server)

    async def everything():
        await client.agenerate(request())
        await client.agenerate_group(request(), 2)
        greedy = GenerationRequest([1, 2], SamplingParams(max_new_tokens=3, greedy=True,
                                                          stop_token_ids=[0], top_k=5))
        await client.agenerate(greedy)
        await client.pause()
        await client.update_weights_from_disk("/weights/v1", 1)
        await client.resume()
        await client.check_versions(0)

    run(everything())
    paths = {p for _, p, _ in server.requests}
    assert paths == {"/generate", "/pause_generation", "/update_weights_from_disk",
                     "/continue_generation", "/model_info", "/server_info"}
    problems = [p for method, path, body in server.requests
                for p in check_request(method, path, body)]
    assert problems == []


def test_the_contract_checker_catches_a_wrong_field():
    # The fixture check is not vacuous: the old field names and removed endpoints fail it.
    assert check_request("POST", "/update_weights_from_disk", {"path": "/w"})
    assert check_request("POST", "/update_weights_from_disk", {"model_path": "/w", "weight_version": 1})
    assert check_request("GET", "/get_weight_version", None)
    assert check_request("POST", "/pause_generation", {"mode": "drain"})
    assert check_request("POST", "/generate", {"input_ids": [1], "sampling_params": {"topk": 1}})


def test_check_versions_names_the_server_and_the_launch_flag():
    server = ScriptedSGLang(lambda body, n: (200, reply([1])))
    client = client_for(server)
    with pytest.raises(Exception, match="--weight-version 3"):
        run(client.check_versions(3))


def test_a_server_behind_the_trainers_version_is_not_routed_to_until_the_next_update():
    """A restarted server answers with the version it started at: its tokens keep that version
    (truthful), and it gets no more requests until a weight update reaches it."""
    hits: list[str] = []
    versions = {"127.0.0.2": "4", "127.0.0.3": "0"}

    async def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/generate":
            hits.append(host)
            await asyncio.sleep(0.01)  # both requests in flight at once
            return httpx.Response(200, json=reply([5], version=versions[host]))
        if request.url.path == "/update_weights_from_disk":
            versions[host] = json.loads(request.content)["weight_version"]
        return httpx.Response(200, json={"success": True, "message": "ok"})

    client = RolloutClient(["http://127.0.0.2:1", "http://127.0.0.3:1"],
                           connect=ScriptedServer(handler), version=PolicyVersion(4))
    request = GenerationRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=1))

    async def go():
        first = await asyncio.gather(*[client.agenerate(request) for _ in range(2)])
        before = len(hits)
        later = [await client.agenerate(request) for _ in range(4)]
        await client.update_weights_from_disk("/w/v5", 5)
        after = await asyncio.gather(*[client.agenerate(request) for _ in range(2)])
        await client.aclose()
        return first, before, later, after

    first, before, later, after = run(go())
    assert sorted(hits[:before]) == ["127.0.0.2", "127.0.0.3"]  # least-in-flight spreads
    assert sorted(r.output_versions[0] for r in first) == [0, 4]
    assert hits[before:before + 4] == ["127.0.0.2"] * 4, "the stale server was skipped"
    assert all(r.output_versions == [4] for r in later)
    assert "127.0.0.3" in hits[before + 4:], "routed to again once the update reached it"
    assert all(r.output_versions == [5] for r in after)


def test_a_monitoring_round_reports_each_server_and_never_raises():
    """server_infos (the rollout profile's and the supervise probe's round): an answer is kept,
    a 200 without a JSON object is alive ({}), an error or a hung server is None, bounded by
    timeout_s for the whole exchange."""
    urls = [f"http://127.0.0.{i}:30000" for i in range(2, 6)]

    async def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host == "127.0.0.2":
            return httpx.Response(200, json={"weight_version": "3"})
        if host == "127.0.0.3":
            return httpx.Response(200, text="ok")
        if host == "127.0.0.4":
            return httpx.Response(500, text="boom")
        await asyncio.sleep(30)  # hung
        return httpx.Response(200, json={})

    async def go():
        client = RolloutClient(urls, connect=ScriptedServer(handler))
        try:
            return await client.server_infos(path="/model_info", timeout_s=0.5, concurrency=2)
        finally:
            await client.aclose()

    infos = asyncio.run(go())
    assert infos == {urls[0]: {"weight_version": "3"}, urls[1]: {}, urls[2]: None, urls[3]: None}


class WithContext(ScriptedSGLang):
    """A server whose /server_info reports a context of ``context`` tokens."""

    def __init__(self, script, context: int):
        super().__init__(script)
        self.context = context

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            self.requests.append((request.method, request.url.path, None))
            return httpx.Response(200, json={"version": "0.5.23", "context_length": self.context,
                                             "max_req_input_len": self.context - 6})
        return await super().__call__(request)


def test_a_budget_over_the_context_is_cut_and_counted_and_a_full_prompt_is_refused():
    """One rule for an over-long prompt, the same whichever server answers: the budget is cut to
    what the context leaves (the server would answer a 400 otherwise), a prompt that leaves no
    room is refused before anything is sent."""
    server = WithContext(lambda body, n: (200, reply([4] * body["sampling_params"][
        "max_new_tokens"], "length")), context=20)
    client = client_for(server)
    # SGLang runs at most context - 2 - prompt new tokens (its scheduler's cut): 12 here
    resp = run(client.agenerate(request(max_new_tokens=15, ids=range(6))))
    sent = [b for _, p, b in server.requests if p == "/generate"]
    assert sent[0]["sampling_params"]["max_new_tokens"] == 12 and resp.budget_clamped
    assert not run(client.agenerate(request(max_new_tokens=12, ids=range(6)))).budget_clamped
    from training_core.transport.rollout_client import PromptTooLong

    with pytest.raises(PromptTooLong, match="prompt of 14 tokens leaves no room"):
        run(client.agenerate(request(ids=range(14))))
    assert len([p for _, p, _ in server.requests if p == "/generate"]) == 2
    assert issubclass(PromptTooLong, RequestRejected)  # an episode error, never retried


def test_every_call_carries_the_runs_server_key(monkeypatch):
    seen: list[str | None] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        if request.url.path == "/generate":
            return httpx.Response(200, json=reply([1]))
        return httpx.Response(200, json={"weight_version": "0", "success": True})

    monkeypatch.setenv("OOLONG_SERVER_KEY", "k3y")
    client = RolloutClient([URL], connect=ScriptedServer(handler))

    async def calls():
        await client.agenerate(request())
        await client.pause()
        await client.resume()
        await client.aclose()

    run(calls())
    assert seen and set(seen) == {"Bearer k3y"}


def test_after_an_in_place_update_sglangs_cache_is_flushed_once_the_paused_requests_drain():
    """SGLang keeps the radix cache's prefixes through an in-place update (flush_cache false: the
    paused requests need their KV): computed under the old weights, new requests would reuse
    them. The server gets no new request until the paused ones have finished, then a flush."""
    release = asyncio.Event()
    log: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        log.append(path)
        if path == "/generate":
            body = json.loads(request.content)
            if body["input_ids"] == [1, 2, 3]:
                await release.wait()  # held on the server across the update
            return httpx.Response(200, json=reply([5], version="1"))
        if path == "/flush_cache":
            return httpx.Response(200, text="Cache flushed.\n")
        if path == "/server_info":
            return httpx.Response(200, json={"version": "0.5.23"})
        return httpx.Response(200, json={"success": True, "message": "ok"})

    client = RolloutClient([URL], connect=ScriptedServer(handler), pause_mode="in_place",
                           flush_after_in_place=True)

    async def scenario():
        held = asyncio.ensure_future(client.agenerate(request(ids=(1, 2, 3))))
        while "/generate" not in log:
            await asyncio.sleep(0.005)
        await client.pause()
        await client.update_weights_from_disk("/w/v1", 1)
        await client.resume()
        fresh = asyncio.ensure_future(client.agenerate(request(ids=(7, 8))))
        for _ in range(20):  # the fresh request waits for the drain and the flush
            await asyncio.sleep(0.01)
        assert log.count("/generate") == 1 and "/flush_cache" not in log
        release.set()
        await held
        await fresh
        await client.aclose()

    run(scenario())
    generates = [i for i, path in enumerate(log) if path == "/generate"]
    assert len(generates) == 2 and generates[0] < log.index("/flush_cache") < generates[1]
