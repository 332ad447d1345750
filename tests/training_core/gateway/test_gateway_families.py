"""Tool calls and reasoning of the Qwen, Hermes, Llama 3 and Mistral families, through the
gateway and the real ``openai`` package, each on its family's chat template
(tests/training_core/chat_templates) and a tokenizer with the family's special tokens.

Those models cannot run here, so the model is scripted: the engine answers each request with the
text the family's model writes (a reasoning block, then a call or an answer), as token ids.
Everything between it and the SDK is the production gateway: the rendering, the exact
continuation, the parsers, the stream. Each test checks the ids trained are the ids sampled."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.training_core.gateway_harness import GatewayThread
from training_core.api import GenerationRequest, GenerationResponse, SamplingParams
from training_core.gateway.chat import ChatRenderer
from training_core.gateway.credit import episode_trajectories
from training_core.gateway.tools import parse_tool_calls, split_reasoning
from training_core.gateway.turn import View
from training_core.models.tiny import build_char_tokenizer

TEMPLATES = Path(__file__).parents[1] / "chat_templates"
CALC = [{"type": "function", "function": {
    "name": "calc", "description": "evaluate arithmetic",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                   "required": ["expr"]}}}]
CHATML = (["<|im_start|>", "<|im_end|>"], ["<tool_call>", "</tool_call>"], "<|im_end|>", None)
FAMILIES = {
    # special tokens, other added tokens, EOS, BOS
    "qwen": CHATML,
    "hermes": CHATML,
    "llama3": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|python_tag|>"], [], "<|eot_id|>", "<|begin_of_text|>"),
    "mistral": (["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                 "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], [], "</s>", "<s>"),
}
# What each family's model writes to call calc(expr="12*7").
CALLS = {
    "qwen": '<tool_call>\n{"name": "calc", "arguments": {"expr": "12*7"}}\n</tool_call>',
    "hermes": '<tool_call>\n{"arguments": {"expr": "12*7"}, "name": "calc"}\n</tool_call>',
    "llama3": '<|python_tag|>{"name": "calc", "parameters": {"expr": "12*7"}}',
    "mistral": '[TOOL_CALLS] [{"name": "calc", "arguments": {"expr": "12*7"}}]',
}


def family_tokenizer(family: str):
    special, added, eos, bos = FAMILIES[family]
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": special})
    tok.add_tokens(added + ["<think>", "</think>"])
    tok.eos_token = eos
    if bos:
        tok.bos_token = bos
    tok.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
    return tok


class ScriptedModel:
    """Answers each request with the next scripted text (as ids, logprob -0.5, version 0), whole
    or streamed token by token; records (prompt, response) as the recording engine does."""

    version = 0

    def __init__(self, tok, script: list[str]):
        self.tok, self.script = tok, list(script)
        self.calls: list[tuple[list[int], GenerationResponse]] = []

    def _next(self, request: GenerationRequest) -> GenerationResponse:
        ids = self.tok.encode(self.script.pop(0), add_special_tokens=False)
        ids = ids[: request.sampling.max_new_tokens]
        return GenerationResponse(list(request.input_ids), ids, [-0.5] * len(ids), [0] * len(ids),
                                  "stop")

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        resp = self._next(request)
        self.calls.append((list(request.input_ids), resp))
        return resp

    async def agenerate_stream(self, request: GenerationRequest):
        resp = self._next(request)
        self.calls.append((list(request.input_ids), resp))
        for n in range(1, len(resp.output_ids) + 1):
            yield GenerationResponse(resp.input_ids, resp.output_ids[:n], resp.output_logprobs[:n],
                                     resp.output_versions[:n], resp.finish_reason if n == len(
                                         resp.output_ids) else "")


def _gateway(family: str, script: list[str]) -> GatewayThread:
    tok = family_tokenizer(family)
    return GatewayThread(None, tok, SamplingParams(max_new_tokens=200),
                         engine=ScriptedModel(tok, script))


def _assert_exact(gw: GatewayThread, session, turns: int) -> None:
    assert len(session.segments) == 1 and session.forks == 0
    (row,) = episode_trajectories(session, 1.0, episode=0)
    for prompt, resp in gw.engine.calls[-turns:]:
        end = len(prompt) + len(resp.output_ids)
        assert row.input_ids[: len(prompt)] == prompt
        assert row.input_ids[len(prompt): end] == resp.output_ids
        assert row.loss_mask[len(prompt): end] == [1] * len(resp.output_ids)
    assert sum(row.loss_mask) == sum(len(r.output_ids) for _, r in gw.engine.calls[-turns:])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_tool_call_and_reasoning_round_trip_on_the_familys_template(family, stream):
    tok = family_tokenizer(family)
    script = ["<think>\nI should use calc.\n</think>\n\n" + CALLS[family] + tok.eos_token,
              "<think>\nIt is 84.\n</think>\n\nThe answer is 84." + tok.eos_token]
    gw = _gateway(family, script)
    try:
        assert gw.gateway.renderer.family == ("hermes" if family == "qwen" else family)
        session = gw.open()
        client = openai.OpenAI(base_url=f"{gw.url}/sessions/{session.id}/v1",
                               api_key=session.key, max_retries=0)
        messages = [{"role": "system", "content": "Use calc."},
                    {"role": "user", "content": "What is 12*7?"}]

        def ask():
            if not stream:
                return client.chat.completions.create(model="m", messages=messages,
                                                      tools=CALC).choices[0]
            with client.chat.completions.stream(model="m", messages=messages, tools=CALC) as s:
                for _ in s:
                    pass
                return s.get_final_completion().choices[0]

        first = ask()
        msg = first.message
        assert first.finish_reason == "tool_calls" and not msg.content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
            ("calc", {"expr": "12*7"})]
        assert getattr(msg, "reasoning_content", None) == "I should use calc."
        messages += [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "84"}]
        second = ask()
        assert second.message.content == "The answer is 84."
        assert second.message.reasoning_content == "It is 84."
        _assert_exact(gw, session, 2)
        # The tool result was rendered in the family's own form, after the exact ids.
        prompt2 = gw.engine.calls[-1][0]
        tail = tok.decode(prompt2[len(gw.engine.calls[-2][0]) + len(gw.engine.calls[-2][1].output_ids):])
        assert "84" in tail and {"qwen": "<tool_response>", "hermes": "<tool_response>",
                                 "llama3": "ipython", "mistral": "[TOOL_RESULTS]"}[family] in tail
        assert session.tool_calls == 1 and session.tool_parse_failures == 0
    finally:
        gw.close()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_parsed_call_renders_back_as_the_family_writes_it(family):
    """A conversation rendered in full (a fork) shows the model its call in its own form."""
    tok = family_tokenizer(family)
    renderer = ChatRenderer(tok)
    parsed = parse_tool_calls(CALLS[family], renderer.family)
    assert parsed.content is None and len(parsed.tool_calls) == 1
    text = renderer.text([{"role": "user", "content": "What is 12*7?"},
                          {"role": "assistant", "content": "", "tool_calls": parsed.tool_calls},
                          {"role": "tool", "tool_call_id": parsed.tool_calls[0]["id"],
                           "content": "84"}], CALC, generation=True)
    assert '"expr": "12*7"' in text and "calc" in text


def test_the_responses_and_anthropic_apis_carry_tool_calls_with_exact_ids():
    tok = family_tokenizer("qwen")
    call, answer = CALLS["qwen"] + tok.eos_token, "It is 84." + tok.eos_token
    gw = _gateway("qwen", [call, answer, call, answer])
    try:
        session = gw.open()
        client = openai.OpenAI(base_url=f"{gw.url}/sessions/{session.id}/v1",
                               api_key=session.key, max_retries=0)
        tools = [{"type": "function", "name": "calc",
                  "parameters": CALC[0]["function"]["parameters"]}]
        first = client.responses.create(model="m", input="What is 12*7?", tools=tools)
        (fc,) = [item for item in first.output if item.type == "function_call"]
        assert fc.name == "calc" and json.loads(fc.arguments) == {"expr": "12*7"}
        second = client.responses.create(model="m", previous_response_id=first.id, tools=tools,
                                         input=[{"type": "function_call_output",
                                                 "call_id": fc.call_id, "output": "84"}])
        assert second.output_text == "It is 84."
        _assert_exact(gw, session, 2)

        session = gw.open()
        url = f"{gw.url}/sessions/{session.id}/v1/messages"
        body = {"model": "c", "max_tokens": 100, "messages": [
            {"role": "user", "content": "What is 12*7?"}],
            "tools": [{"name": "calc", "input_schema": CALC[0]["function"]["parameters"]}]}
        out = httpx.post(url, headers={"x-api-key": session.key}, json=body).json()
        assert out["stop_reason"] == "tool_use"
        (use,) = out["content"]
        assert use["type"] == "tool_use" and use["input"] == {"expr": "12*7"}
        body["messages"] += [{"role": "assistant", "content": out["content"]},
                             {"role": "user", "content": [{"type": "tool_result",
                                                           "tool_use_id": use["id"],
                                                           "content": "84"}]}]
        out = httpx.post(url, headers={"x-api-key": session.key}, json=body).json()
        assert out["content"] == [{"type": "text", "text": "It is 84."}]
        assert out["stop_reason"] == "end_turn"
        _assert_exact(gw, session, 2)
    finally:
        gw.close()


def test_parallel_tool_calls_false_stops_after_the_first_call():
    tok = family_tokenizer("qwen")
    two = CALLS["qwen"] + "\n" + CALLS["qwen"].replace("12*7", "1+1") + tok.eos_token
    gw = _gateway("qwen", [two])
    try:
        session = gw.open()
        client = openai.OpenAI(base_url=f"{gw.url}/sessions/{session.id}/v1",
                               api_key=session.key, max_retries=0)
        msg = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], tools=CALC,
            parallel_tool_calls=False, stop=["never"]).choices[0].message
        assert len(msg.tool_calls) == 1
        _, resp = gw.engine.calls[-1]
        kept = session.segments[-1].ids[len(gw.engine.calls[-1][0]):]
        assert kept == resp.output_ids[: len(kept)]
        assert tok.decode(kept).endswith("</tool_call>")  # cut after the first call, as sampled
    finally:
        gw.close()


def test_reasoning_split_and_the_stream_view_is_a_prefix_of_the_answer():
    assert split_reasoning("<think>a\n</think>\n\nb") == ("a", "b")
    assert split_reasoning("a</think>b", opened=True) == ("a", "b")
    assert split_reasoning("still thinking", opened=True) == ("still thinking", "")
    assert split_reasoning("no think") == (None, "no think")
    text = '<think>\nplan  \n</think>\n\nSure: <tool_call>\n{"name": "calc", "arguments": {}}' \
           '\n</tool_call>'
    view = View("hermes", True, False, ["STOP"])
    sent = {"reasoning": "", "content": ""}
    for n in range(1, len(text) + 1):
        for d in view.update(text[:n]):
            sent[d.kind] += d.text
            assert sent[d.kind] == view.sent[d.kind]
    reasoning, rest = split_reasoning(text)
    parsed = parse_tool_calls(rest, "hermes")
    deltas, r, c = view.finish(reasoning, parsed.content)
    assert (r, c) == ("plan", "Sure:") and not deltas  # nothing held back that is not the answer


@pytest.mark.parametrize("text,family,calls,failed", [
    ('{"name": "calc", "parameters": {"expr": "1"}}; {"name": "now", "parameters": {}}',
     "llama3", ["calc", "now"], False),
    ("The answer is 4.", "llama3", [], False),
    ('<|python_tag|>{"name": "calc", "parameters": [1]}', "llama3", [], True),
    ('[TOOL_CALLS]calc[ARGS]{"expr": "1"}', "mistral", ["calc"], False),
    ('[TOOL_CALLS] [{"name": "calc"', "mistral", [], True),
    ('<tool_call>[{"name": "calc", "arguments": {}}, {"name": "now", "arguments": {}}]</tool_call>',
     "smollm2", ["calc", "now"], False),
])
def test_parsers(text, family, calls, failed):
    parsed = parse_tool_calls(text, family)
    assert [c["function"]["name"] for c in parsed.tool_calls] == calls
    assert parsed.failed == failed
    if family == "mistral":
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in parsed.tool_calls)


def test_a_client_gone_before_the_first_event_leaves_the_session_usable():
    """A streamed turn whose client hangs up releases the session (the next request is served,
    and the abandoned turn changed nothing)."""
    import socket

    tok = family_tokenizer("qwen")
    gw = _gateway("qwen", ["first answer" + tok.eos_token, "second" + tok.eos_token])
    try:
        session = gw.open()
        host, port = gw.url.removeprefix("http://").split(":")
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True})
        s = socket.create_connection((host, int(port)))
        s.sendall((f"POST /sessions/{session.id}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                   f"Authorization: Bearer {session.key}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        s.close()  # gone at once
        client = openai.OpenAI(base_url=f"{gw.url}/sessions/{session.id}/v1",
                               api_key=session.key, max_retries=0, timeout=30)
        out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert out.choices[0].message.content in ("first answer", "second")
        assert not session.lock.locked()
    finally:
        gw.close()
