"""Tool calls: how tools are shown to a model whose chat template cannot, and how the model's
tool-call text becomes OpenAI ``tool_calls``.

Two families are parsed, both wrapped in ``<tool_call>...</tool_call>``:
- Hermes / Qwen: one JSON object per tag, ``{"name": ..., "arguments": {...}}``, several tags
  for several calls;
- SmolLM2 (its function-calling prompt, APIGen style): one tag holding a JSON list of such
  objects.
Either form is accepted whatever the model; the family only decides how tools are described to a
model whose template ignores ``tools`` (SmolLM2's does).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

TAG = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class Parsed:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    failed: bool = False  # tool-call text that could not be parsed (returned as text)


def parse_tool_calls(text: str) -> Parsed:
    """``text`` split into content and OpenAI tool calls. A tag whose body is not a call (bad
    JSON, no name, arguments not an object) makes the whole answer plain text, ``failed``."""
    if "<tool_call>" not in text:
        return Parsed(text)
    calls: list[dict[str, Any]] = []
    for body in TAG.findall(text):
        try:
            value = json.loads(body.strip())
        except ValueError:
            return Parsed(text, failed=True)
        for call in value if isinstance(value, list) else [value]:
            if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]):
                return Parsed(text, failed=True)
            args = call.get("arguments", call.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    return Parsed(text, failed=True)
            if not isinstance(args, dict):
                return Parsed(text, failed=True)
            calls.append({"id": "call_" + secrets.token_hex(8), "type": "function",
                          "function": {"name": call["name"], "arguments": json.dumps(args)}})
    if not calls:  # e.g. SmolLM2's "no call needed": <tool_call>[]</tool_call>
        return Parsed(TAG.sub("", text).strip() or None)
    content = text[: text.index("<tool_call>")].strip()
    return Parsed(content or None, calls)


def tool_schemas(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``function`` part of each OpenAI tool (what the prompts show)."""
    return [t.get("function", t) for t in tools]


SMOLLM2_TOOLS = (
    "You are an expert in composing functions. You are given a question and a set of possible "
    "functions. Based on the question, you will need to make one or more function/tool calls to "
    "achieve the purpose.\n\nYou have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "To call tools, answer only in this format:\n<tool_call>[\n{{\"name\": \"func_name1\", "
    "\"arguments\": {{\"argument1\": \"value1\"}}}}\n]</tool_call>\nOtherwise answer in text."
)

HERMES_TOOLS = (
    "You may call one or more functions.\n<tools>\n{tools}\n</tools>\nFor each call, answer "
    "<tool_call>{{\"name\": <function-name>, \"arguments\": <args-json-object>}}</tool_call>"
)


def tools_system_prompt(tools: list[dict[str, Any]], family: str) -> str:
    schemas = tool_schemas(tools)
    if family == "smollm2":
        return SMOLLM2_TOOLS.format(tools=json.dumps(schemas))
    return HERMES_TOOLS.format(tools="\n".join(json.dumps(s) for s in schemas))


def call_text(tool_calls: list[dict[str, Any]], family: str) -> str:
    """An assistant's earlier tool calls as the text the model family writes (for templates
    that do not render ``tool_calls`` themselves)."""
    calls = [{"name": c["function"]["name"], "arguments": _args(c["function"].get("arguments"))}
             for c in tool_calls]
    if family == "smollm2":
        return "<tool_call>" + json.dumps(calls) + "</tool_call>"
    return "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls)


def _args(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value if value is not None else {}
