"""What an agent asks for, checked field by field: every API the gateway speaks (chat
completions, responses, Anthropic messages) becomes one :class:`TurnRequest` of plain chat
messages. A malformed message or part is a 400 naming it (``messages[2].tool_calls[0].function``),
never a 500; an image, audio or file part is refused (the policy is a text model).

Normal form of a message: ``{"role", "content": str}`` plus, where they apply, ``tool_calls``
(OpenAI's ``[{"id", "type": "function", "function": {"name", "arguments": <JSON text>}}]``),
``tool_call_id`` and ``name``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio", "file", "input_file",
               "document")
# Sampling fields an agent may send; what the gateway does with them is the run's sampling
# policy (sampling.py).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "frequency_penalty",
                   "presence_penalty", "logit_bias", "top_logprobs")


class BadRequest(Exception):
    """A 4xx naming the field (OpenAI's error shape: ``param``, ``code``)."""

    def __init__(self, param: str | None, message: str, status: int = 400,
                 code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@dataclass
class TurnRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None  # OpenAI's {"type": "function", "function": {...}}
    tool_choice: Any = "auto"  # auto | none | required | {"name": <tool>}
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    logprobs: bool = False
    include_usage: bool = False
    parallel_tool_calls: bool = True
    sampling: dict[str, Any] = field(default_factory=dict)  # what the agent sent (SAMPLING_FIELDS)
    # Leading messages a later request does not inherit by previous_response_id (the
    # Responses API's instructions apply to one request).
    instructions: int = 0

    @property
    def forced_tool(self) -> str | None:
        return self.tool_choice.get("name") if isinstance(self.tool_choice, dict) else None

    def text_size(self) -> int:
        """Characters of everything rendered into the prompt (bounds the tokenizer's work)."""
        size = sum(len(m.get("content") or "") for m in self.messages)
        size += sum(len(c["function"]["arguments"]) + len(c["function"]["name"])
                    for m in self.messages for c in m.get("tool_calls") or [])
        return size + (len(json.dumps(self.tools)) if self.tools else 0)


def _text_parts(parts: list[Any], where: str) -> str:
    out = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            out.append(part)
            continue
        if not isinstance(part, dict):
            raise BadRequest(f"{where}[{j}]", "a content part must be an object with a type")
        kind = part.get("type")
        if kind in MEDIA_PARTS:
            raise BadRequest(f"{where}[{j}].type", f"{kind} parts are not supported: the policy "
                             "is a text model (no vision or audio model is configured); send text")
        if kind not in ("text", "input_text", "output_text", "refusal"):
            raise BadRequest(f"{where}[{j}].type", f"unknown content part type {kind!r}: use text")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise BadRequest(f"{where}[{j}].text", "a text part needs a string text")
        out.append(text)
    return "".join(out)


def content_text(content: Any, where: str, *, required: bool) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if content is None:
        if required:
            raise BadRequest(where, "content is required: a string or a list of text parts")
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return _text_parts(content, where)
    raise BadRequest(where, "content must be a string or a list of text parts")


def tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise BadRequest(where, "a tool call must be an object {id, type, function}")
    if call.get("type", "function") != "function":
        raise BadRequest(f"{where}.type", "only function tool calls are supported")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise BadRequest(f"{where}.function", "a tool call needs function: {name, arguments}")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where}.function.name", "a tool call needs the function's name")
    args = fn.get("arguments", "{}")
    if isinstance(args, dict):
        args = json.dumps(args)
    if not isinstance(args, str):
        raise BadRequest(f"{where}.function.arguments", "arguments must be a JSON string")
    cid = call.get("id")
    if cid is not None and not isinstance(cid, str):
        raise BadRequest(f"{where}.id", "a tool call id must be a string")
    return {"id": cid or "", "type": "function", "function": {"name": name, "arguments": args}}


def chat_messages(messages: Any, param: str = "messages") -> list[dict[str, Any]]:
    """OpenAI chat messages in normal form (module doc); 400 naming the first bad field."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest(param, f"{param} must be a non-empty list of chat messages")
    out = []
    for i, m in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(where, "each message must be an object with a role")
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"{where}.role", f"each message needs a role, one of {ROLES}")
        role = "system" if role == "developer" else role  # OpenAI's newer name for system
        msg: dict[str, Any] = {"role": role, "content": content_text(
            m.get("content"), f"{where}.content", required=role != "assistant")}
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise BadRequest(f"{where}.tool_calls", "only assistant messages carry tool_calls")
            if not isinstance(calls, list):
                raise BadRequest(f"{where}.tool_calls", "tool_calls must be a list")
            if calls:
                msg["tool_calls"] = [tool_call(c, f"{where}.tool_calls[{j}]")
                                     for j, c in enumerate(calls)]
        for key in ("tool_call_id", "name"):
            value = m.get(key)
            if value is not None:
                if not isinstance(value, str):
                    raise BadRequest(f"{where}.{key}", f"{key} must be a string")
                msg[key] = value
        out.append(msg)
    return out


def openai_tools(tools: Any, param: str = "tools") -> list[dict[str, Any]] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise BadRequest(param, "tools must be a list of {type: function, function: {...}}")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise BadRequest(f"{param}[{i}].type", "only function tools are supported")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"{param}[{i}].function", "a tool needs function: {name, "
                             "description, parameters}")
        out.append({"type": "function", "function": fn})
    return out


def tool_choice(choice: Any, tools: list[dict[str, Any]] | None, param: str = "tool_choice") -> Any:
    """auto | none | required | {"name": <a declared tool>}."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise BadRequest(param, "tool_choice must be auto, none, required or a named tool")
        if choice == "required" and not tools:
            raise BadRequest(param, "tool_choice required needs tools")
        return choice
    name = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
    if not isinstance(name, str):
        raise BadRequest(param, 'a named tool_choice is {"type": "function", "function": '
                         '{"name": ...}}')
    if name not in {t["function"]["name"] for t in tools or []}:
        raise BadRequest(param, f"tool_choice names {name!r}, which is not in tools")
    return {"name": name}


def max_tokens(value: Any, param: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(param, f"{param} must be a positive integer")
    return value


def stop_strings(value: Any, param: str = "stop") -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > 4 or not all(
            isinstance(s, str) and s for s in value):
        raise BadRequest(param, f"{param} must be a string or a list of up to 4 non-empty strings")
    return list(value)


def chat_request(body: Any) -> TurnRequest:
    """``POST /v1/chat/completions``."""
    if not isinstance(body, dict):
        raise BadRequest("body", "the body must be a JSON object")
    messages = chat_messages(body.get("messages"))
    if body.get("n", 1) not in (1, None):
        raise BadRequest("n", "n must be 1: each completion is one turn of one episode (the run's "
                         "group size sets how many episodes each task gets)")
    fmt = body.get("response_format")
    if fmt and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise BadRequest("response_format", "structured output is not supported: leave "
                         "response_format out")
    tools = openai_tools(body.get("tools"))
    options = body.get("stream_options") or {}
    return TurnRequest(
        messages=messages, tools=tools, tool_choice=tool_choice(body.get("tool_choice"), tools),
        max_tokens=max_tokens(body.get("max_completion_tokens", body.get("max_tokens")),
                              "max_tokens"),
        stop=stop_strings(body.get("stop")), stream=bool(body.get("stream")),
        logprobs=bool(body.get("logprobs")),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        sampling={k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None})
