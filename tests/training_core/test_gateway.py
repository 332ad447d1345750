"""The gateway with the real ``openai`` package, in front of a real embedded server."""

from __future__ import annotations

import json

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
    stream = _client(gw, session).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "2+2="}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    _, resp = gw.engine.calls[-1]
    assert text == gw.tokenizer.decode(resp.output_ids, skip_special_tokens=True)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(resp.output_ids)


@pytest.mark.parametrize("field,kwargs", [
    ("temperature", {"temperature": 0.2}), ("n", {"n": 2}), ("stop", {"stop": ["\n"]}),
    ("top_p", {"top_p": 0.5}), ("tool_choice", {"tool_choice": "required", "tools": CALC}),
    ("logit_bias", {"logit_bias": {"5": 10}}), ("max_tokens", {"max_tokens": 0}),
])
def test_run_fixed_sampling_is_refused_naming_the_field(gw, field, kwargs):
    session = gw.open()
    with pytest.raises(openai.BadRequestError) as err:
        _client(gw, session).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "1+1="}], **kwargs)
    assert err.value.body["param"] == field
    assert session.turns == 0  # nothing generated


def test_the_run_temperature_itself_and_a_smaller_max_tokens_are_accepted(gw):
    session = gw.open()
    out = _client(gw, session).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "1+1="}], temperature=1.0, max_tokens=3)
    assert out.usage.completion_tokens <= 3


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
    assert grpo[0][1] == pytest.approx(1.0, abs=1e-4) and grpo[2][1] == pytest.approx(-1.0, abs=1e-4)


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


def test_a_streamed_tool_call_assembles_in_the_openai_sdk():
    """The gateway's chunks for a tool-call answer, fed to the SDK's own stream accumulator."""
    import asyncio

    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from training_core.gateway.server import _chunks

    parsed = parse_tool_calls('<tool_call>{"name": "calc", "arguments": {"expr": "6*7"}}</tool_call>')
    completion = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
                  "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None,
                               "message": {"role": "assistant", "content": parsed.content,
                                           "tool_calls": parsed.tool_calls}}],
                  "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}

    async def collect():
        return [e async for e in _chunks(completion, include_usage=True)]

    events = asyncio.run(collect())
    assert events[-1] == "[DONE]"
    state = ChatCompletionStreamState(input_tools=CALC)
    for event in events[:-1]:
        state.handle_chunk(ChatCompletionChunk.model_validate(json.loads(json.dumps(event))))
    final = state.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "calc"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"expr": "6*7"}
    assert final.usage.total_tokens == 8
