"""The gateway with the real ``openai`` package, in front of a real embedded server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.training_core.gateway_harness import GatewayThread
from training_core.algorithms.presets import resolve_algorithm
from training_core.api import SamplingParams, TrajectoryGroup
from training_core.gateway.chat import ChatRenderer
from training_core.gateway.credit import episode_trajectories, segment_advantages, turn_returns
from training_core.gateway.tools import parse_tool_calls
from training_core.models.loading import load_tokenizer

CALC = [{"type": "function", "function": {
    "name": "calc", "description": "evaluate arithmetic",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                   "required": ["expr"]}}}]


@pytest.fixture(scope="module")
def gw(server, tiny_model_dir):
    thread = GatewayThread(server, load_tokenizer(tiny_model_dir),
                           SamplingParams(max_new_tokens=8, temperature=1.0))
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def gw_refuse(server, tiny_model_dir):
    thread = GatewayThread(server, load_tokenizer(tiny_model_dir),
                           SamplingParams(max_new_tokens=8, temperature=1.0), policy="refuse")
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def gw_pass(server, tiny_model_dir):
    thread = GatewayThread(server, load_tokenizer(tiny_model_dir),
                           SamplingParams(max_new_tokens=12, temperature=1.0), policy="pass")
    yield thread
    thread.close()


def _client(gw, session) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/sessions/{session.id}/v1", api_key=session.key,
                         max_retries=0)


def test_models_and_a_completion(gw):
    session = gw.open()
    client = _client(gw, session)
    assert [m.id for m in client.models.list().data] == ["oolong-policy"]
    out = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "1+2="}])
    (engine_prompt, resp), = gw.engine.calls[-1:]
    choice = out.choices[0]
    assert choice.message.content == gw.tokenizer.decode(resp.output_ids, skip_special_tokens=True)
    assert out.usage.completion_tokens == len(resp.output_ids) and 1 <= len(resp.output_ids) <= 8
    assert out.usage.prompt_tokens == len(engine_prompt)
    assert choice.finish_reason in ("stop", "length")


def test_streaming_gives_the_same_completion_in_chunks(gw):
    session = gw.open()
    streamed = gw.engine.streamed  # before the request: the gateway may stream before create returns
    stream = _client(gw, session).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "2+2="}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    _, resp = gw.engine.calls[-1]
    assert text == gw.tokenizer.decode(resp.output_ids, skip_special_tokens=True)
    # Real streaming: the server sent each token as it was sampled, and the gateway passed them
    # on (a chunk per visible token, not one at the end). The finish comes with the last token
    # (SGLang) or as one more event after it (the embedded server).
    assert len(resp.output_ids) <= gw.engine.streamed - streamed <= len(resp.output_ids) + 1
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= min(2, len(text))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(resp.output_ids)


@pytest.mark.parametrize("field,kwargs", [
    ("temperature", {"temperature": 0.2}), ("top_p", {"top_p": 0.5}),
    ("logit_bias", {"logit_bias": {"5": 10}}), ("seed", {"seed": 7}),
    ("presence_penalty", {"presence_penalty": 0.5}),
])
def test_the_refuse_policy_names_the_field(gw_refuse, field, kwargs):
    session = gw_refuse.open()
    with pytest.raises(openai.BadRequestError) as err:
        _client(gw_refuse, session).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "1+1="}], **kwargs)
    assert err.value.body["param"] == field
    assert session.turns == 0 and session.failure is None  # nothing generated, episode goes on


@pytest.mark.parametrize("field,kwargs", [
    ("n", {"n": 2}), ("max_tokens", {"max_tokens": 0}),
    ("tool_choice", {"tool_choice": {"type": "function", "function": {"name": "nope"}},
                     "tools": CALC}),
    ("response_format", {"response_format": {"type": "json_object"}}),
])
def test_what_no_policy_can_honour_is_refused_naming_the_field(gw, field, kwargs):
    session = gw.open()
    with pytest.raises(openai.BadRequestError) as err:
        _client(gw, session).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "1+1="}], **kwargs)
    assert err.value.body["param"] == field
    assert session.turns == 0


def test_the_override_policy_samples_as_the_run_and_reports_what_it_overrode(gw):
    session = gw.open()
    raw = _client(gw, session).chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "1+1="}], temperature=0, seed=3,
        top_p=1.0, max_tokens=3)
    out = raw.parse()
    assert out.usage.completion_tokens <= 3
    assert raw.headers["x-oolong-sampling-overridden"] == "temperature=0,seed=3"
    assert raw.headers["x-oolong-session"] == session.id
    sent = gw.engine.requests[-1].sampling
    assert sent.temperature == 1.0 and not sent.greedy  # the run's sampling, not the agent's
    assert session.sampling_overrides == 1 and session.log[-1]["sampling_overridden"]
    assert set(session.segments[-1].temperatures) == {0.0}  # the run's temperature throughout


def test_the_pass_policy_samples_and_trains_at_the_agents_temperature(gw_pass):
    session = gw_pass.open()
    client = _client(gw_pass, session)
    messages = [{"role": "user", "content": "1+1="}]
    out = client.chat.completions.create(model="m", messages=messages, temperature=0.5)
    assert gw_pass.engine.requests[-1].sampling.temperature == 0.5
    seg = session.segments[-1]
    assert {t for t, m in zip(seg.temperatures, seg.mask, strict=True) if m} == {0.5}
    (row,) = episode_trajectories(session, 1.0, episode=0)  # the trainer gets them per token
    assert [t for t, m in zip(row.info["token_temperatures"], row.loss_mask, strict=True)
            if m] == [0.5] * sum(row.loss_mask)
    # temperature 0: greedy, and a greedy turn is context, never trained
    messages += [out.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "again"}]
    client.chat.completions.create(model="m", messages=messages, temperature=0)
    assert gw_pass.engine.requests[-1].sampling.greedy
    _, resp = gw_pass.engine.calls[-1]
    assert seg.mask[-len(resp.output_ids):] == [0] * len(resp.output_ids)
    assert session.turns == 2 and len(session.segments) == 1  # still one exact segment
    with pytest.raises(openai.BadRequestError) as err:  # not reproducible by the trainer
        client.chat.completions.create(model="m", messages=messages, frequency_penalty=1.0)
    assert err.value.body["param"] == "frequency_penalty"


def test_stop_cuts_after_the_stop_string_and_keeps_the_sampled_ids(gw_pass):
    """Greedy (pass policy, temperature 0) makes the completion known: the second request
    stops at a character of it."""
    messages = [{"role": "user", "content": "3*4="}]
    full = _client(gw_pass, gw_pass.open()).chat.completions.create(
        model="m", messages=messages, temperature=0)
    _, greedy = gw_pass.engine.calls[-1]
    text = full.choices[0].message.content
    assert len(text) >= 4, text
    stop = text[2]
    session = gw_pass.open()
    out = _client(gw_pass, session).chat.completions.create(
        model="m", messages=messages, temperature=0, stop=[stop])
    assert out.choices[0].message.content == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    seg = session.segments[-1]
    kept = [t for t, m in zip(seg.ids, seg.turns, strict=True) if m == 0] or \
        seg.ids[len(gw_pass.engine.calls[-1][0]):]
    # The ids up to the token that completed the stop string, exactly as sampled.
    assert kept == greedy.output_ids[: len(kept)] and 0 < len(kept) < len(greedy.output_ids)
    assert stop in gw_pass.tokenizer.decode(kept) and stop not in gw_pass.tokenizer.decode(kept[:-1])
    assert out.usage.completion_tokens == len(kept)
    # Streamed: the same answer, the generation cancelled at the stop string.
    chunks = list(_client(gw_pass, gw_pass.open()).chat.completions.create(
        model="m", messages=messages, temperature=0, stop=[stop], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        text[: text.index(stop)]


def test_a_required_or_named_tool_call_is_opened_in_the_prompt(gw):
    session = gw.open()
    out = _client(gw, session).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "12*7?"}], tools=CALC,
        tool_choice={"type": "function", "function": {"name": "calc"}})
    prompt, resp = gw.engine.calls[-1]
    opening = '<tool_call>\n{"name": "calc", "arguments": '
    assert gw.tokenizer.decode(prompt).endswith(opening)
    seg = session.segments[-1]
    assert seg.mask[: len(prompt)] == [0] * len(prompt)  # the opening is prompt, not trained
    assert seg.ids[len(prompt):] == resp.output_ids
    msg = out.choices[0].message
    # The tiny model writes no valid JSON: the agent sees the call as text (a parse failure).
    assert msg.tool_calls or msg.content.startswith(opening)
    assert session.tool_parse_failures == (0 if msg.tool_calls else 1)
    with pytest.raises(openai.BadRequestError) as err:
        _client(gw, session).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], tool_choice="required")
    assert err.value.body["param"] == "tool_choice"


def test_context_overflow_is_context_length_exceeded_and_the_episode_goes_on(gw):
    session = gw.open()
    client = _client(gw, session)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "7" * 600}])
    assert err.value.code == "context_length_exceeded" and err.value.body["param"] == "messages"
    assert session.turns == 0 and session.failure is None and not session.segments
    # The agent trims its history and goes on.
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "7"}])
    assert session.turns == 1 and session.rejected == 1


@pytest.mark.parametrize("messages,param", [
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": "c1"}]}],
     "messages[1].tool_calls[0].function"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": 5}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}],
     "messages[0].content[1].type"),
    ([{"role": "function", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "x"}, "not a message"], "messages[1]"),
    ([{"role": "tool", "content": "1", "tool_call_id": 3}], "messages[0].tool_call_id"),
    ({"role": "user"}, "messages"),
])
def test_a_malformed_message_is_a_400_naming_it(gw, messages, param):
    session = gw.open()
    resp = httpx.post(f"{gw.url}/sessions/{session.id}/v1/chat/completions",
                      headers={"Authorization": f"Bearer {session.key}"},
                      json={"model": "m", "messages": messages})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert session.turns == 0 and session.failure is None


def test_keys_and_sessions_are_checked(gw):
    session = gw.open()
    bad = openai.OpenAI(base_url=f"{gw.url}/sessions/{session.id}/v1", api_key="sk-guess",
                        max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    other = gw.open()
    wrong = openai.OpenAI(base_url=f"{gw.url}/sessions/{session.id}/v1", api_key=other.key,
                          max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    # The run key plus a session header reaches that session.
    by_header = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=gw.gateway.run_key, max_retries=0,
                              default_headers={"X-Oolong-Session": session.id})
    by_header.chat.completions.create(model="m", messages=[{"role": "user", "content": "3+3="}])
    assert session.turns == 1


def test_turn_limit_fails_the_episode(gw):
    from training_core.gateway.session import AgentLimits

    session = gw.open(limits=AgentLimits(max_turns=1))
    client = _client(gw, session)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1="}])
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1="}])
    assert "turn limit" in session.failure


def scripted_conversation(gw, session, turns: int = 5) -> list:
    """An agent loop: tools declared; a tool result after a tool call, else a tool-style user
    message; the assistant message sent back exactly as received (the SDK's object)."""
    client = _client(gw, session)
    messages: list = [{"role": "system", "content": "Use calc."},
                      {"role": "user", "content": "What is 12*7?"}]
    outs = []
    for t in range(turns):
        out = client.chat.completions.create(model="m", messages=messages, tools=CALC)
        outs.append(out)
        msg = out.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if msg.tool_calls:
            for call in msg.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "84"})
        elif t % 2 == 0:  # a tool result the agent injects by itself (a prior call's answer)
            messages.append({"role": "user", "content": f"calc returned {t}"})
        else:
            messages.append({"role": "user", "content": "Go on."})
    return outs


def assert_exact(gw, session, n_calls: int) -> None:
    """Every trained token id and behaviour logprob is the server's, in one segment."""
    calls = gw.engine.calls[-n_calls:]
    assert len(session.segments) == 1 and session.forks == 0
    (row,) = episode_trajectories(session, 1.0, episode=0)
    for t, (prompt, resp) in enumerate(calls):
        end = len(prompt) + len(resp.output_ids)
        assert row.input_ids[: len(prompt)] == prompt  # every prompt extends the last one
        assert row.input_ids[len(prompt): end] == resp.output_ids
        assert row.logprobs[len(prompt): end] == resp.output_logprobs
        assert row.versions[len(prompt): end] == resp.output_versions
        assert row.loss_mask[len(prompt): end] == [1] * len(resp.output_ids)
        assert row.info["turn_ids"][len(prompt): end] == [t] * len(resp.output_ids)
    # Loss only on sampled tokens: as many as the server sampled, nothing else.
    assert sum(row.loss_mask) == sum(len(r.output_ids) for _, r in calls)
    assert len(row.input_ids) == len(calls[-1][0]) + len(calls[-1][1].output_ids)


def test_five_turns_keep_the_exact_sampled_tokens_tiny(gw):
    session = gw.open()
    scripted_conversation(gw, session)
    assert_exact(gw, session, 5)
    # The first prompt is the template's rendering of the opening messages with the tools.
    first_prompt = gw.engine.calls[-5][0]
    assert gw.tokenizer.decode(first_prompt).startswith("<|system|>\nUse calc.\ntools: ")


def test_a_rewritten_history_starts_a_new_segment(gw):
    session = gw.open()
    client = _client(gw, session)
    msgs = [{"role": "user", "content": "1+2="}]
    out = client.chat.completions.create(model="m", messages=msgs)
    msgs += [{"role": "assistant", "content": (out.choices[0].message.content or "") + "EDITED"},
             {"role": "user", "content": "again"}]
    client.chat.completions.create(model="m", messages=msgs)
    assert len(session.segments) == 2 and session.forks == 1
    rows = episode_trajectories(session, [0.5, 1.0], episode=0)
    prompt2, resp2 = gw.engine.calls[-1]
    assert rows[1].input_ids == prompt2 + resp2.output_ids
    assert gw.tokenizer.decode(prompt2).count("EDITED") == 1  # rendered in full


def test_responses_api_multi_turn_by_previous_id_and_by_full_input(gw):
    """The OpenAI Agents SDK's default API, with the real openai package; exact ids after each
    turn, whichever way the agent carries its history."""
    session = gw.open()
    client = _client(gw, session)
    first = client.responses.create(model="m", instructions="Use calc.", input="What is 12*7?",
                                    tools=[{"type": "function", "name": "calc",
                                            "parameters": CALC[0]["function"]["parameters"]}])
    assert first.status in ("completed", "incomplete") and first.id.startswith("resp_")
    _, resp = gw.engine.calls[-1]
    assert first.output_text == gw.tokenizer.decode(resp.output_ids, skip_special_tokens=True)
    assert first.usage.output_tokens == len(resp.output_ids)
    # By id: only the new item is sent.
    second = client.responses.create(model="m", instructions="Use calc.", previous_response_id=first.id,
                                     input=[{"role": "user", "content": "Go on."}],
                                     tools=[{"type": "function", "name": "calc",
                                             "parameters": CALC[0]["function"]["parameters"]}])
    assert_exact(gw, session, 2)
    # By the whole history, the earlier output items sent back as they came.
    history = [{"role": "user", "content": "What is 12*7?"},
               *[item.model_dump(exclude_none=True) for item in first.output],
               {"role": "user", "content": "Go on."},
               *[item.model_dump(exclude_none=True) for item in second.output],
               {"role": "user", "content": "And?"}]
    client.responses.create(model="m", instructions="Use calc.", input=history,
                            tools=[{"type": "function", "name": "calc",
                                    "parameters": CALC[0]["function"]["parameters"]}])
    assert_exact(gw, session, 3)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="m", input="x", previous_response_id="resp_nope")
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="m", input="x", tools=[{"type": "web_search"}])
    assert err.value.body["param"] == "tools[0].type"


def test_responses_api_streams_the_same_answer(gw):
    session = gw.open()
    client = _client(gw, session)
    events = list(client.responses.create(model="m", input="2+2=", stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                             "response.incomplete")
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    _, resp = gw.engine.calls[-1]
    assert text == final.output_text == gw.tokenizer.decode(resp.output_ids,
                                                            skip_special_tokens=True)
    client.responses.create(model="m", previous_response_id=final.id, input="more")
    assert_exact(gw, session, 2)


def test_anthropic_messages_multi_turn_and_streaming(gw):
    """An Anthropic-style client (x-api-key, content blocks, named SSE events)."""
    session = gw.open()
    url = f"{gw.url}/sessions/{session.id}/v1/messages"
    headers = {"x-api-key": session.key, "anthropic-version": "2023-06-01"}
    body = {"model": "claude", "max_tokens": 8, "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "1+2="}]}]}
    first = httpx.post(url, headers=headers, json=body).json()
    _, resp = gw.engine.calls[-1]
    assert first["type"] == "message" and first["role"] == "assistant"
    assert first["content"][0]["text"] == gw.tokenizer.decode(resp.output_ids,
                                                              skip_special_tokens=True)
    assert first["stop_reason"] in ("end_turn", "max_tokens")
    assert first["usage"]["output_tokens"] == len(resp.output_ids)
    body["messages"] += [{"role": "assistant", "content": first["content"]},
                         {"role": "user", "content": "more"}]
    body["stream"] = True
    with httpx.stream("POST", url, headers=headers, json=body) as stream:
        lines = [line for line in stream.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    deltas = [json.loads(line.removeprefix("data: ")) for line in lines
              if line.startswith("data: ") and '"content_block_delta"' in line]
    _, resp = gw.engine.calls[-1]
    assert "".join(d["delta"]["text"] for d in deltas) == gw.tokenizer.decode(
        resp.output_ids, skip_special_tokens=True)
    assert_exact(gw, session, 2)
    bad = httpx.post(url, headers=headers, json={"model": "c", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]})
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    assert bad.json()["error"]["message"].startswith("messages[0].content[0].type")
    unauthorized = httpx.post(url, headers={"x-api-key": "wrong"}, json=body)
    assert unauthorized.status_code == 401


def test_chat_streaming_keeps_the_exact_ids_across_turns(gw):
    session = gw.open()
    client = _client(gw, session)
    messages: list = [{"role": "user", "content": "1+1="}]
    for _ in range(3):
        chunks = list(client.chat.completions.create(model="m", messages=messages, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "and?"}]
    assert_exact(gw, session, 3)


# ---- tool calls, rendering, credit (no server) ----------------------------------------------

def test_hermes_and_smollm2_tool_calls_parse():
    hermes = parse_tool_calls('ok <tool_call>{"name": "calc", "arguments": {"expr": "1+2"}}'
                              '</tool_call><tool_call>{"name": "calc", "arguments": {"expr": "3"}}'
                              '</tool_call>')
    assert hermes.content == "ok" and not hermes.failed
    assert [json.loads(c["function"]["arguments"]) for c in hermes.tool_calls] == [
        {"expr": "1+2"}, {"expr": "3"}]
    smol = parse_tool_calls('<tool_call>[{"name": "calc", "arguments": {"expr": "2*3"}}, '
                            '{"name": "now", "arguments": {}}]</tool_call>')
    assert [c["function"]["name"] for c in smol.tool_calls] == ["calc", "now"]
    assert smol.content is None
    for broken in ('<tool_call>{"name": calc}</tool_call>', '<tool_call>{"arguments": {}}',
                   '<tool_call>{"name": "x", "arguments": [1]}</tool_call>'):
        parsed = parse_tool_calls(broken)
        assert parsed.failed and parsed.content == broken and not parsed.tool_calls


def test_tools_go_to_the_system_prompt_when_the_template_ignores_them(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                         "assistant\n{% endif %}")
    renderer = ChatRenderer(tok, "smollm2")
    text = renderer.text([{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": "c1", "type": "function",
                               "function": {"name": "calc", "arguments": '{"expr": "1"}'}}]}],
                         CALC, generation=False)
    assert text.startswith("<|im_start|>system\nYou are an expert in composing functions")
    assert '<|im_start|>assistant\n<tool_call>[{"name": "calc", "arguments": {"expr": "1"}}]' in text


def test_turn_returns_discount_and_per_completion():
    assert turn_returns(1.0, 3, 0.5) == [0.25, 0.5, 1.0]
    assert turn_returns([1.0, 0.0, 2.0], 3, 0.5) == [1.5, 1.0, 2.0]
    assert turn_returns(1.0, 2, 1.0) == [1.0, 1.0]
    for bad in ([1.0], "1", None, float("nan")):
        with pytest.raises(ValueError):
            turn_returns(bad, 2, 1.0)


def test_group_baseline_over_trajectories_reaches_every_segment():
    from training_core.api import Trajectory

    def seg(ep, ret, returns, mask):
        return Trajectory([1] * len(mask), mask, [0.0] * len(mask), [0] * len(mask), ret,
                          info={"episode": ep, "episode_return": ret, "token_returns": returns})

    # Episode 0 (return 1) has two segments; episode 1 (return 0) one: the baseline is over the
    # two trajectories, not the three rows.
    group = TrajectoryGroup([seg(0, 1.0, [0, 1.0, 1.0], [0, 1, 1]), seg(0, 1.0, [0, 1.0], [0, 1]),
                             seg(1, 0.0, [0, 0.0], [0, 1])])
    adv = segment_advantages([group], resolve_algorithm("dr_grpo"))
    assert adv == [[0.0, 0.5, 0.5], [0.0, 0.5], [0.0, -0.5]]
    grpo = segment_advantages([group], resolve_algorithm("grpo"))
    # GRPO divides by the sample std of the returns 1, 0 (sqrt(1/2)): +-0.5 / 0.707 = +-0.707
    half = 0.5 / 0.5 ** 0.5
    assert grpo[0][1] == pytest.approx(half, abs=1e-4) and grpo[2][1] == pytest.approx(-half, abs=1e-4)


@pytest.mark.slow
def test_five_turns_keep_the_exact_sampled_tokens_smollm2(tmp_path):
    """SmolLM2's ChatML template (turns end with its EOS, <|im_end|>, plus a newline the model
    does not write) and its tool form in the system prompt."""
    from tests.training_core.conftest import start_server
    from training_core.models.smollm2 import ensure_smollm2

    model_dir = ensure_smollm2()
    fleet, url = start_server(model_dir, tmp_path / "server.log")
    tok = load_tokenizer(model_dir)
    gw = GatewayThread(url, tok, SamplingParams(max_new_tokens=24, temperature=1.0))
    try:
        session = gw.open()
        scripted_conversation(gw, session)
        assert_exact(gw, session, 5)
        prompts = [p for p, _ in gw.engine.calls[-5:]]
        assert tok.decode(prompts[0]).startswith(
            "<|im_start|>system\nYou are an expert in composing functions")
        # Where a turn ended with <|im_end|>, the next prompt continues with the template's
        # newline and the next message, not a second end marker.
        for (p, r), nxt in zip(gw.engine.calls[-5:-1], prompts[1:], strict=True):
            if r.output_ids and r.output_ids[-1] == tok.eos_token_id:
                assert tok.decode(nxt[len(p) + len(r.output_ids):]).startswith("\n<|im_start|>")
    finally:
        gw.close()
        fleet.stop()
