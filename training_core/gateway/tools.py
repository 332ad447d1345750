"""Tool calls and reasoning as each model family writes them: how tools are shown to a model
whose chat template cannot, how the model's text becomes OpenAI ``tool_calls``, and where its
``<think>`` reasoning ends.

Families (``rollout.agent.tool_format``; ``auto`` reads the chat template):

- ``hermes`` / ``qwen`` (Hermes 2 Pro, Qwen 2.5 and 3): one JSON object per
  ``<tool_call>...</tool_call>`` tag, ``{"name": ..., "arguments": {...}}``;
- ``smollm2`` (its function-calling prompt, APIGen style): one tag holding a JSON list of calls;
- ``llama3`` (Llama 3.1 / 3.2 JSON tool calling): the answer is the call, optionally after
  ``<|python_tag|>``: ``{"name": ..., "parameters": {...}}``, several separated by ``;``;
- ``mistral`` (v0.3 and later): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``, or
  the compact ``[TOOL_CALLS]name[ARGS]{...}`` of newer templates.

Text that starts a call but does not parse (bad JSON, no name, arguments not an object) is
returned as plain content and counted as a parse failure: the model is trained on what it wrote,
and the agent sees it.

Reasoning: text up to ``</think>`` (after an opening ``<think>``, written by the model or ending
the prompt, as Qwen3 and DeepSeek-R1 templates do) is the turn's reasoning; the rest is parsed for
content and calls.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("hermes", "qwen", "llama3", "mistral", "smollm2")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TAG = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
# Special tokens that carry meaning for the parsers: kept when a completion is decoded (every
# other special token, end-of-turn markers included, is dropped from the text).
MARKERS = ("<tool_call>", "</tool_call>", THINK_OPEN, THINK_CLOSE, PYTHON_TAG, MISTRAL_CALLS,
           "[ARGS]", "[CALL_ID]")


@dataclass
class Parsed:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    failed: bool = False  # tool-call text that could not be parsed (returned as text)


def family_of(template: str) -> str:
    """The tool-call family a chat template speaks (``auto``)."""
    if "SmolLM" in template:
        return "smollm2"
    if "[TOOL_CALLS]" in template or "[INST]" in template:
        return "mistral"
    if "<|start_header_id|>" in template or PYTHON_TAG in template:
        return "llama3"
    return "hermes"


def call_id(family: str = "hermes") -> str:
    """A new tool call's id; Mistral's templates require 9 letters and digits."""
    if family == "mistral":
        return "".join(secrets.choice(ALNUM) for _ in range(9))
    return "call_" + secrets.token_hex(8)


ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def _call(name: Any, args: Any) -> dict[str, Any] | None:
    """One OpenAI tool call, or None when ``name``/``args`` are not a call."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if args is None:
        args = {}
    if not (isinstance(name, str) and name and isinstance(args, dict)):
        return None
    return {"id": "", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def _calls_from(value: Any) -> list[dict[str, Any]] | None:
    out = []
    for item in value if isinstance(value, list) else [value]:
        if not isinstance(item, dict):
            return None
        call = _call(item.get("name"), item.get("arguments", item.get("parameters", {})))
        if call is None:
            return None
        out.append(call)
    return out


def parse_tool_calls(text: str, family: str = "hermes") -> Parsed:
    """``text`` split into content and OpenAI tool calls, as ``family`` writes them."""
    if family == "llama3":
        parsed = _parse_llama3(text)
    elif family == "mistral":
        parsed = _parse_mistral(text)
    else:
        parsed = _parse_tags(text)
    for call in parsed.tool_calls:
        call["id"] = call_id(family)
    return parsed


def _parse_tags(text: str) -> Parsed:
    """Hermes, Qwen (one object per tag) and SmolLM2 (a list in one tag) alike."""
    if "<tool_call>" not in text:
        return Parsed(text)
    calls: list[dict[str, Any]] = []
    for body in TAG.findall(text):
        try:
            value = json.loads(body.strip())
        except ValueError:
            return Parsed(text, failed=True)
        found = _calls_from(value)
        if found is None:
            return Parsed(text, failed=True)
        calls += found
    if not calls:  # e.g. SmolLM2's "no call needed": <tool_call>[]</tool_call>
        return Parsed(TAG.sub("", text).strip() or None)
    content = text[: text.index("<tool_call>")].rstrip()
    return Parsed(content or None, calls)


def _parse_llama3(text: str) -> Parsed:
    if PYTHON_TAG in text:
        content, _, body = text.partition(PYTHON_TAG)
    elif text.lstrip().startswith("{"):
        content, body = "", text
    else:
        return Parsed(text)
    decoder, calls, i = json.JSONDecoder(), [], 0
    body = body.strip()
    while i < len(body):
        try:
            value, end = decoder.raw_decode(body, i)
        except ValueError:
            break
        found = _calls_from(value)
        if found is None:
            break
        calls += found
        i = end
        while i < len(body) and body[i] in " \n\t;":
            i += 1
    if not calls or i < len(body):
        # Plain JSON that is not a call is plain text; a call that does not parse is a failure.
        return Parsed(text, failed=PYTHON_TAG in text or '"name"' in body)
    return Parsed(content.rstrip() or None, calls)


def _parse_mistral(text: str) -> Parsed:
    if MISTRAL_CALLS not in text:
        return Parsed(text)
    content, _, body = text.partition(MISTRAL_CALLS)
    body = body.strip()
    calls: list[dict[str, Any]] | None = []
    if body.startswith(("[", "{")):
        try:
            calls = _calls_from(json.loads(body))
        except ValueError:
            calls = None
    else:  # compact: name[ARGS]{...}, repeated
        decoder = json.JSONDecoder()
        while body:
            name, sep, rest = body.partition("[ARGS]")
            if not sep:
                calls = None
                break
            try:
                args, end = decoder.raw_decode(rest.lstrip())
            except ValueError:
                calls = None
                break
            call = _call(name.strip(), args)
            if call is None:
                calls = None
                break
            calls.append(call)
            body = rest.lstrip()[end:].strip().removeprefix(MISTRAL_CALLS).strip()
    if not calls:
        return Parsed(text, failed=True)
    return Parsed(content.rstrip() or None, calls)


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, the rest) of a completion. ``opened``: the prompt ends inside ``<think>``
    (the template opened it). Without ``</think>`` the whole text is reasoning when it was
    opened, else there is none."""
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        opened, text = True, stripped[len(THINK_OPEN):]
    if not opened:
        return None, text
    reasoning, sep, rest = text.partition(THINK_CLOSE)
    if not sep:
        return reasoning.strip() or None, ""
    return reasoning.strip() or None, rest.lstrip()


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
    if family == "llama3":
        return ";".join(json.dumps({"name": c["name"], "parameters": c["arguments"]})
                        for c in calls)
    if family == "mistral":
        return MISTRAL_CALLS + " " + json.dumps(calls)
    return "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls)


def forced_prefix(family: str, name: str | None) -> str:
    """The text an answer starts with when a call is required (``tool_choice: required``, or a
    named tool): it is put in the prompt, so the model samples the rest of the call."""
    if family == "llama3":
        return '{"name": ' + json.dumps(name) + ', "parameters": ' if name else '{"name": "'
    if family == "mistral":
        return MISTRAL_CALLS + ' [{"name": ' + json.dumps(name) + ', "arguments": ' if name \
            else MISTRAL_CALLS + ' [{"name": "'
    if family == "smollm2":
        return '<tool_call>[{"name": ' + json.dumps(name) + ', "arguments": ' if name \
            else '<tool_call>[{"name": "'
    return '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": ' if name \
        else '<tool_call>\n{"name": "'


def first_call_end(text: str, family: str) -> int | None:
    """Where the first complete call of ``text`` ends, for families that close each call
    (``parallel_tool_calls: false`` stops there); None where calls are not closed one by one."""
    if family in ("hermes", "qwen"):
        i = text.find("</tool_call>")
        return None if i < 0 else i + len("</tool_call>")
    return None


def _args(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value if value is not None else {}
