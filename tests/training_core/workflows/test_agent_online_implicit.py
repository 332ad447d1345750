"""Online mode from another host's point of view (issue 51.3): one URL and the run key, nothing
else. The server finds each request's episode from its conversation, groups the episodes of one
task, and takes rewards by any answer's id; the URL it advertises is never 0.0.0.0."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

from training_core.api import SamplingParams
from training_core.config import AgentSpec
from training_core.models.loading import load_tokenizer
from training_core.transport.rollout_client import RolloutClient
from training_core.workflows.base import WorkflowContext
from training_core.workflows.online import OnlineWorkflow


@pytest.fixture
def online(server, tiny_model_dir):
    ctx = WorkflowContext(tokenizer=load_tokenizer(tiny_model_dir), rewards=None,  # type: ignore[arg-type]
                          sampling=SamplingParams(max_new_tokens=6), group_size=2,
                          agent=AgentSpec(gateway_host="0.0.0.0", timeout_s=120))
    wf = OnlineWorkflow(ctx)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    client = RolloutClient([server])
    episode = asyncio.run_coroutine_threadsafe(wf.arun_episode(client, {}), loop)  # one admitted group
    while wf.gateway is None or not wf._free:
        threading.Event().wait(0.05)
    yield wf, episode
    episode.cancel()
    asyncio.run_coroutine_threadsafe(wf.gateway.aclose(), loop).result(30)
    asyncio.run_coroutine_threadsafe(client.aclose(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _agent(url: str, key: str, question: str, out: list) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    messages = [{"role": "system", "content": "Answer."}, {"role": "user", "content": question}]
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(model="m", messages=messages)
        reply = raw.parse()
        out.append((raw.headers["x-oolong-session"], reply.id))
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "more"}]


def test_one_url_one_key_sessions_found_and_grouped_by_the_server(online):
    wf, episode = online
    assert "0.0.0.0" not in wf.url  # the host's name: usable from another host
    local = wf.gateway.url.replace("0.0.0.0", "127.0.0.1")
    key = wf.gateway.run_key
    answers: list[list] = [[], []]
    agents = [threading.Thread(target=_agent, args=(local, key, "3+4=", answers[i]))
              for i in range(2)]
    for a in agents:
        a.start()
    for a in agents:
        a.join(120)
    # Each agent's two turns landed in one session; the two agents in two sessions of one group.
    sessions = [{sid for sid, _ in a} for a in answers]
    assert all(len(s) == 1 for s in sessions) and sessions[0] != sessions[1]
    (group,) = {wf.gateway.sessions[next(iter(s))].group for s in sessions}
    for s in sessions:
        session = wf.gateway.sessions[next(iter(s))]
        assert session.turns == 2 and len(session.segments) == 1 and session.forks == 0
    http = httpx.Client(base_url=local, headers={"Authorization": f"Bearer {key}"})
    for i, a in enumerate(answers):  # rewards by an answer's id (the client has nothing else)
        resp = http.post("/rl/reward", json={"response_id": a[-1][1], "reward": float(i)})
        assert resp.status_code == 200 and resp.json()["group"] == group, resp.text
    result = episode.result(60)
    assert sorted(s.info["episode_return"] for s in result.samples) == [0.0, 1.0]
    assert http.post("/rl/reward", json={"response_id": "chatcmpl-nope", "reward": 1}
                     ).status_code == 404


def test_a_third_episode_of_the_task_waits_for_capacity_and_sessions_use_the_hosts_name(online):
    wf, _ = online
    local = wf.gateway.url.replace("0.0.0.0", "127.0.0.1")
    http = httpx.Client(base_url=local, headers={"Authorization": f"Bearer {wf.gateway.run_key}",
                                                 "Host": "gw.example:8700"})
    first = http.post("/rl/sessions", json={}).json()
    assert first["base_url"] == f"http://gw.example:8700/sessions/{first['id']}/v1"
    # The one admitted group is taken: a new one is refused until the staleness bound has room.
    refused = http.post("/rl/sessions", json={})
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "no_capacity"
    client = openai.OpenAI(base_url=local + "/v1", api_key=wf.gateway.run_key, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
