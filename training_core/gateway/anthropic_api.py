"""Anthropic's Messages API, ``POST /v1/messages``, on the same exact-id sessions.

``system``, ``messages`` with text, ``tool_use`` and ``tool_result`` blocks (``thinking`` blocks
of earlier turns are accepted and not rendered: the exact ids hold them), ``tools`` with
``input_schema``, ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``), ``stop_sequences``,
``max_tokens`` and ``stream``. The key comes as ``x-api-key`` or a bearer token. Errors have
Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``, the message naming the
field (``messages[1].content[0]``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from training_core.gateway.chat_api import turn_headers
from training_core.gateway.http import EventStream, Response
from training_core.gateway.requests import (
    MEDIA_PARTS,
    BadRequest,
    TurnRequest,
    content_text,
    max_tokens,
    stop_strings,
    tool_choice,
)
from training_core.gateway.turn import Answer, Delta, Turn

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}


def error(status: int, message: str, param: str | None = None) -> Response:
    text = f"{param}: {message}" if param and not message.startswith(param) else message
    return Response(status, {"type": "error", "error": {
        "type": ERROR_TYPES.get(status, "api_error"), "message": text, "param": param}})


def _block_text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise BadRequest(f"{where}.text", "a text block needs a string text")
    return text


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": content_text(system, "system", required=True)})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "messages must be a non-empty list")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise BadRequest(f"{where}.role", "each message needs a role: user or assistant")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise BadRequest(f"{where}.content", "content must be a string or a list of blocks")
        text, calls, results = [], [], []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(_block_text(block, at))
            elif kind in MEDIA_PARTS:
                raise BadRequest(f"{at}.type", f"{kind} blocks are not supported: the policy is a "
                                 "text model (no vision model is configured)")
            elif kind in ("thinking", "redacted_thinking"):
                continue
            elif kind == "tool_use" and m["role"] == "assistant":
                cid, name, args = block.get("id"), block.get("name"), block.get("input", {})
                if not isinstance(cid, str) or not isinstance(name, str) or not name:
                    raise BadRequest(at, "a tool_use block needs an id and a name")
                if not isinstance(args, dict):
                    raise BadRequest(f"{at}.input", "a tool_use input must be an object")
                calls.append({"id": cid, "type": "function",
                              "function": {"name": name, "arguments": json.dumps(args)}})
            elif kind == "tool_result" and m["role"] == "user":
                cid = block.get("tool_use_id")
                if not isinstance(cid, str):
                    raise BadRequest(f"{at}.tool_use_id", "a tool_result needs its tool_use_id")
                results.append({"role": "tool", "tool_call_id": cid, "content": content_text(
                    block.get("content", ""), f"{at}.content", required=False)})
            else:
                raise BadRequest(f"{at}.type", f"block type {kind!r} is not supported in a "
                                 f"{m['role']} message")
        if m["role"] == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        else:
            out += results
            if text or not results:
                out.append({"role": "user", "content": "".join(text)})
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools", "tools must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise BadRequest(f"tools[{i}]", "a tool needs a name (and input_schema)")
        if t.get("type") not in (None, "custom"):
            raise BadRequest(f"tools[{i}].type", "only custom (client) tools are supported")
        out.append({"type": "function", "function": {
            "name": t["name"], "description": t.get("description", ""),
            "parameters": t.get("input_schema", {"type": "object"})}})
    return out


def turn_request(body: Any) -> TurnRequest:
    if not isinstance(body, dict):
        raise BadRequest("body", "the body must be a JSON object")
    messages = _messages(body)
    tools = _tools(body.get("tools"))
    choice, parallel = body.get("tool_choice"), True
    if choice is not None:
        if not isinstance(choice, dict):
            raise BadRequest("tool_choice", "tool_choice must be {type: auto|any|tool|none}")
        parallel = not choice.get("disable_parallel_tool_use", False)
        kind = choice.get("type")
        choice = {"auto": "auto", "none": "none", "any": "required"}.get(kind) if kind != "tool" \
            else {"name": choice.get("name")}
        if choice is None:
            raise BadRequest("tool_choice.type", "tool_choice.type must be auto, any, tool or none")
    if "max_tokens" not in body:
        raise BadRequest("max_tokens", "max_tokens is required")
    sampling = {k: body[k] for k in ("temperature", "top_p", "top_k") if body.get(k) is not None}
    return TurnRequest(messages=messages, tools=tools, tool_choice=tool_choice(choice, tools),
                       max_tokens=max_tokens(body.get("max_tokens"), "max_tokens"),
                       stop=stop_strings(body.get("stop_sequences"), "stop_sequences"),
                       stream=bool(body.get("stream")), parallel_tool_calls=parallel,
                       sampling=sampling)


def _stop_reason(answer: Answer) -> str:
    if answer.tool_calls:
        return "tool_use"
    if answer.finish == "length":
        return "max_tokens"
    return "stop_sequence" if answer.stop_matched else "end_turn"


def _blocks(answer: Answer) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if answer.reasoning:
        out.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.content or not answer.tool_calls:
        out.append({"type": "text", "text": answer.content or ""})
    out += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
             "input": json.loads(c["function"]["arguments"])} for c in answer.tool_calls]
    return out


def message(turn: Turn, answer: Answer | None, model: str) -> dict[str, Any]:
    return {"id": "msg_" + turn.id, "type": "message", "role": "assistant", "model": model,
            "content": _blocks(answer) if answer else [],
            "stop_reason": _stop_reason(answer) if answer else None,
            "stop_sequence": answer.stop_matched if answer else None,
            "usage": {"input_tokens": answer.prompt_tokens if answer else len(turn.plan.prompt),
                      "output_tokens": answer.completion_tokens if answer else 0,
                      "cache_read_input_tokens": answer.cached_tokens if answer else 0}}


async def serve(body: Any, open_turn: Any, model: str) -> Response | EventStream:
    req = turn_request(body)
    turn: Turn = await open_turn(req)
    if not req.stream:
        answer = await turn.run()
        return Response(200, message(turn, answer, model), turn_headers(turn))
    events = turn.stream()
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    return EventStream(_events(turn, first, events, model), headers=turn_headers(turn),
                       close=events.aclose)


async def _events(turn: Turn, first: Delta | Answer, events: AsyncIterator[Delta | Answer],
                  model: str) -> AsyncIterator[Any]:
    def event(kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        return kind, {"type": kind, **data}

    async with contextlib.aclosing(events):
        yield event("message_start", message=message(turn, None, model))
        index, open_kind = -1, None

        def start(kind: str) -> list[tuple[str, dict[str, Any]]]:
            nonlocal index, open_kind
            out = [event("content_block_stop", index=index)] if open_kind else []
            index += 1
            open_kind = kind
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "reasoning" \
                else {"type": "text", "text": ""}
            return out + [event("content_block_start", index=index, content_block=block)]

        item = first
        while isinstance(item, Delta):
            if open_kind != item.kind:
                for e in start(item.kind):
                    yield e
            delta = {"type": "thinking_delta", "thinking": item.text} if item.kind == "reasoning" \
                else {"type": "text_delta", "text": item.text}
            yield event("content_block_delta", index=index, delta=delta)
            item = await anext(events)
        answer = item
        if open_kind != "content" and (answer.content or not answer.tool_calls):
            for e in start("content"):
                yield e
        if open_kind:
            yield event("content_block_stop", index=index)
        for call in answer.tool_calls:
            index += 1
            yield event("content_block_start", index=index, content_block={
                "type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                "input": {}})
            yield event("content_block_delta", index=index, delta={
                "type": "input_json_delta", "partial_json": call["function"]["arguments"]})
            yield event("content_block_stop", index=index)
        yield event("message_delta", delta={"stop_reason": _stop_reason(answer),
                                            "stop_sequence": answer.stop_matched},
                    usage={"output_tokens": answer.completion_tokens})
        yield event("message_stop")
