"""OpenAI's ``POST /v1/responses`` (the OpenAI Agents SDK's default) on the same exact-id
sessions as chat completions.

The request's ``input`` (a string, or items: messages, ``function_call`` and
``function_call_output`` items, earlier ``reasoning`` items) and ``instructions`` become chat
messages; ``previous_response_id`` prepends the conversation of a response this session gave
(its input and output), so multi-turn works either way: by the id, or by sending the whole
history back. An answer's output items (reasoning, message, function calls) map back to the one
assistant message the gateway keeps, so the next turn continues from the ids as sampled.

Function tools only (``{"type": "function", "name", "parameters"}``); built-in tools (web
search, file search, computer use) are a 400 naming ``tools[i].type``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from training_core.gateway.chat_api import turn_headers
from training_core.gateway.http import EventStream, Response
from training_core.gateway.requests import (
    SAMPLING_FIELDS,
    BadRequest,
    TurnRequest,
    content_text,
    max_tokens,
    tool_choice,
)
from training_core.gateway.turn import Answer, Delta, Turn


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools", "tools must be a list of function tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise BadRequest(f"tools[{i}].type", f"only function tools are supported, not "
                             f"{kind!r}: the policy runs no built-in tools")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise BadRequest(f"tools[{i}].name", "a function tool needs a name")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _choice(choice: Any, tools: list[dict[str, Any]] | None) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return tool_choice({"name": choice.get("name")}, tools)
    if isinstance(choice, dict) and choice.get("type") not in (None, "function"):
        raise BadRequest("tool_choice", "only function tools can be chosen")
    return tool_choice(choice, tools)


def input_messages(items: Any, param: str = "input") -> list[dict[str, Any]]:
    """Responses input items as chat messages in normal form; consecutive assistant message and
    function_call items become one assistant message with ``tool_calls``."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise BadRequest(param, "input must be a string or a list of items")
    out: list[dict[str, Any]] = []

    def assistant() -> dict[str, Any]:
        if out and out[-1]["role"] == "assistant" and "_open" in out[-1]:
            return out[-1]
        out.append({"role": "assistant", "content": "", "_open": True})
        return out[-1]

    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(where, "each input item must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(f"{where}.role", "role must be user, system, developer or "
                                 "assistant")
            text = content_text(item.get("content"), f"{where}.content", required=True)
            if role == "assistant":
                msg = assistant()
                msg["content"] += text
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            name, args, cid = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not isinstance(name, str) or not name:
                raise BadRequest(f"{where}.name", "a function_call needs a name")
            if not isinstance(args, str):
                raise BadRequest(f"{where}.arguments", "arguments must be a JSON string")
            if not isinstance(cid, str):
                raise BadRequest(f"{where}.call_id", "a function_call needs its call_id")
            assistant().setdefault("tool_calls", []).append(
                {"id": cid, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind == "function_call_output":
            cid, output = item.get("call_id"), item.get("output")
            if not isinstance(cid, str):
                raise BadRequest(f"{where}.call_id", "a function_call_output needs its call_id")
            out.append({"role": "tool", "tool_call_id": cid,
                        "content": content_text(output, f"{where}.output", required=True)})
        elif kind == "reasoning":
            continue  # earlier reasoning: the exact ids hold it; a fresh render drops it
        else:
            raise BadRequest(f"{where}.type", f"input item type {kind!r} is not supported: use "
                             "message, function_call, function_call_output")
    for m in out:
        m.pop("_open", None)
    return out


def turn_request(body: Any, previous: list[dict[str, Any]] | None) -> TurnRequest:
    if not isinstance(body, dict):
        raise BadRequest("body", "the body must be a JSON object")
    messages = list(previous or []) + input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None:
        messages.insert(0, {"role": "system", "content": content_text(
            instructions, "instructions", required=True)})
    first = int(instructions is not None)
    if not messages:
        raise BadRequest("input", "input is empty")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise BadRequest("text.format", "structured output is not supported: leave text.format "
                         "out")
    tools = _tools(body.get("tools"))
    return TurnRequest(
        messages=messages, tools=tools, tool_choice=_choice(body.get("tool_choice"), tools),
        max_tokens=max_tokens(body.get("max_output_tokens"), "max_output_tokens"),
        stream=bool(body.get("stream")),
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        sampling={k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None},
        instructions=first)


def output_items(answer: Answer) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if answer.reasoning:
        out.append({"type": "reasoning", "id": "rs_" + answer.id, "summary": [],
                    "content": [{"type": "reasoning_text", "text": answer.reasoning}],
                    "status": "completed"})
    if answer.content or not answer.tool_calls:
        out.append(_message_item(answer, answer.content or "", "completed"))
    for k, call in enumerate(answer.tool_calls):
        out.append(_call_item(answer, k, call))
    return out


def _message_item(answer_or_turn: Any, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": "msg_" + answer_or_turn.id, "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
            if status == "completed" else []}


def _call_item(answer: Answer, k: int, call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{answer.id}_{k}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": "completed"}


def response(turn: Turn, body: dict[str, Any], answer: Answer | None, model: str) -> dict[str, Any]:
    done = answer is not None
    out: dict[str, Any] = {
        "id": "resp_" + turn.id, "object": "response", "created_at": turn.created,
        "model": model, "status": "in_progress", "output": [], "error": None,
        "incomplete_details": None, "instructions": body.get("instructions"),
        "metadata": body.get("metadata") or {}, "parallel_tool_calls": turn.req.parallel_tool_calls,
        "temperature": turn.sampling.temperature, "top_p": turn.sampling.top_p,
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"), "text": {"format": {"type": "text"}},
        "truncation": "disabled", "usage": None}
    if done:
        out["status"] = "incomplete" if answer.finish == "length" else "completed"
        if answer.finish == "length":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        out["output"] = output_items(answer)
        out["usage"] = {"input_tokens": answer.prompt_tokens,
                        "input_tokens_details": {"cached_tokens": answer.cached_tokens},
                        "output_tokens": answer.completion_tokens,
                        "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": answer.prompt_tokens + answer.completion_tokens}
    return out


async def serve(body: Any, previous_of: Any, open_turn: Any, model: str) -> Response | EventStream:
    """``previous_of(response_id)`` is that response's conversation (or raises);
    ``open_turn(turn_request) -> Turn``."""
    previous = None
    if isinstance(body, dict) and body.get("previous_response_id") is not None:
        rid = body["previous_response_id"]
        if not isinstance(rid, str):
            raise BadRequest("previous_response_id", "previous_response_id must be a string")
        previous = previous_of(rid.removeprefix("resp_"))
    req = turn_request(body, previous)
    turn: Turn = await open_turn(req)
    if not req.stream:
        answer = await turn.run()
        return Response(200, response(turn, body, answer, model), turn_headers(turn))
    events = turn.stream()
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    return EventStream(_events(turn, body, first, events, model), headers=turn_headers(turn),
                       close=events.aclose)


async def _events(turn: Turn, body: dict[str, Any], first: Delta | Answer,
                  events: AsyncIterator[Delta | Answer], model: str) -> AsyncIterator[Any]:
    seq = iter(range(1 << 30))

    def event(kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        return kind, {"type": kind, "sequence_number": next(seq), **data}

    async with contextlib.aclosing(events):
        yield event("response.created", response=response(turn, body, None, model))
        yield event("response.in_progress", response=response(turn, body, None, model))
        index = -1
        open_kind: str | None = None  # the item being streamed: reasoning | message
        texts = {"reasoning": "", "content": ""}

        def close_item() -> list[tuple[str, dict[str, Any]]]:
            if open_kind == "reasoning":
                text = texts["reasoning"]
                part = {"type": "reasoning_text", "text": text}
                item = {"type": "reasoning", "id": "rs_" + turn.id, "summary": [],
                        "content": [part], "status": "completed"}
                return [event("response.reasoning_text.done", item_id=item["id"],
                              output_index=index, content_index=0, text=text),
                        event("response.content_part.done", item_id=item["id"],
                              output_index=index, content_index=0, part=part),
                        event("response.output_item.done", output_index=index, item=item)]
            if open_kind == "message":
                text = texts["content"]
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                item = _message_item(turn, text, "completed")
                return [event("response.output_text.done", item_id=item["id"],
                              output_index=index, content_index=0, text=text, logprobs=[]),
                        event("response.content_part.done", item_id=item["id"],
                              output_index=index, content_index=0, part=part),
                        event("response.output_item.done", output_index=index, item=item)]
            return []

        def open_item(kind: str) -> list[tuple[str, dict[str, Any]]]:
            nonlocal index, open_kind
            out = close_item()
            index += 1
            open_kind = kind
            if kind == "reasoning":
                item_id = "rs_" + turn.id
                return out + [
                    event("response.output_item.added", output_index=index,
                          item={"type": "reasoning", "id": item_id, "summary": [], "content": [],
                                "status": "in_progress"}),
                    event("response.content_part.added", item_id=item_id, output_index=index,
                          content_index=0, part={"type": "reasoning_text", "text": ""})]
            item = _message_item(turn, "", "in_progress")
            return out + [
                event("response.output_item.added", output_index=index, item=item),
                event("response.content_part.added", item_id=item["id"], output_index=index,
                      content_index=0, part={"type": "output_text", "text": "",
                                             "annotations": [], "logprobs": []})]

        item = first
        while True:
            if isinstance(item, Delta):
                kind = "reasoning" if item.kind == "reasoning" else "message"
                if open_kind != kind:
                    for e in open_item(kind):
                        yield e
                texts[item.kind] += item.text
                if kind == "reasoning":
                    yield event("response.reasoning_text.delta", item_id="rs_" + turn.id,
                                output_index=index, content_index=0, delta=item.text)
                else:
                    yield event("response.output_text.delta", item_id="msg_" + turn.id,
                                output_index=index, content_index=0, delta=item.text,
                                logprobs=[])
                item = await anext(events)
                continue
            answer = item
            if open_kind != "message" and (answer.content or not answer.tool_calls):
                for e in open_item("message"):  # an empty answer is still a message
                    yield e
            for e in close_item():
                yield e
            for k, call in enumerate(answer.tool_calls):
                index += 1
                done = _call_item(answer, k, call)
                yield event("response.output_item.added", output_index=index,
                            item={**done, "arguments": "", "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=done["id"],
                            output_index=index, delta=done["arguments"])
                yield event("response.function_call_arguments.done", item_id=done["id"],
                            output_index=index, arguments=done["arguments"])
                yield event("response.output_item.done", output_index=index, item=done)
            final = response(turn, body, answer, model)
            yield event("response.incomplete" if final["status"] == "incomplete"
                        else "response.completed", response=final)
            return
