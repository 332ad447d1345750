"""Chat messages to token ids, in full or as a continuation of ids the model already has.

The continuation is what keeps training exact across turns: the model's sampled tokens are never
decoded and tokenized again. Only the *new* messages (tool results, the next user turn) are
rendered, as the text the chat template would put after the previous assistant turn, found by
rendering a fixed two-message conversation with and without them and taking the difference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from training_core.gateway.tools import (
    MARKERS,
    THINK_OPEN,
    call_text,
    family_of,
    tools_system_prompt,
)

# For tokenizers without a chat template (the tiny model): ChatML-like and short (the tiny model
# has a character tokenizer and 512 positions), tools described in the system turn and called in
# the Hermes form. Turns end with the EOS token, so the model learns to stop there.
FALLBACK_TEMPLATE = (
    # Newlines are written as expressions: Hugging Face renders with trim_blocks, which eats a
    # newline that follows a block tag.
    "{% if tools or messages[0].role == 'system' %}{{ '<|system|>\\n' }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "{% if tools %}{% if messages[0].role == 'system' %}{{ '\\n' }}{% endif %}{{ 'tools: ' }}"
    # Each tool as a signature, not its JSON schema: the tiny model has 512 positions, and a
    # calculator's schema took 290 of them (this form: 100).
    "{% for t in tools %}{% set f = t.function or t %}{% if not loop.first %}{{ '; ' }}{% endif %}"
    "{{ f.name }}({% for k, v in ((f.parameters or {}).properties or {}).items() %}"
    "{% if not loop.first %}{{ ', ' }}{% endif %}{{ k }}: {{ v.type or 'any' }}{% endfor %})"
    "{% if f.description %}{{ ' - ' + f.description }}{% endif %}{% endfor %}"
    "{{ '\\ncall: <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>' }}{% endif %}"
    "{{ eos_token + '\\n' }}{% endif %}"
    "{% for m in messages %}{% if not (loop.first and m.role == 'system') %}"
    "{{ '<|' + m.role + '|>\\n' }}{% if m.content %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ '<tool_call>{\"name\": ' }}"
    "{{ c.function.name | tojson }}{{ ', \"arguments\": ' }}{{ c.function.arguments | tojson }}"
    "{{ '}</tool_call>' }}{% endfor %}{% endif %}{{ eos_token + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Sentinels of the fixed conversation the continuation is measured against.
_USER, _ASSISTANT = "\u2063\u2064user\u2064\u2063", "\u2063\u2064assistant\u2064\u2063"


def canonical(message: dict[str, Any]) -> dict[str, Any]:
    """What identifies a message for prefix matching: role, text, tool calls (name and parsed
    arguments), tool_call_id, name. Call ids, reasoning and SDK extras (refusal, audio, ...) do
    not count. Takes messages in the normal form of requests.py."""
    out: dict[str, Any] = {"role": message.get("role"), "content": message.get("content") or ""}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [(c["function"]["name"], _json_or_text(c["function"]["arguments"]))
                             for c in calls]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _json_or_text(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.dumps(json.loads(value), sort_keys=True)
        except ValueError:
            return value
    return json.dumps(value, sort_keys=True)


def context_length(tokenizer: Any) -> int | None:
    """The model's context (``max_position_embeddings`` of the model next to the tokenizer, else
    the tokenizer's ``model_max_length`` when it is a real bound); None when unknown."""
    path = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "config.json"
    try:
        value = json.loads(path.read_text()).get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    except (OSError, ValueError, AttributeError):
        pass
    value = getattr(tokenizer, "model_max_length", None)
    return value if isinstance(value, int) and 0 < value < 10**7 else None


class ChatRenderer:
    """One tokenizer's chat rendering and decoding. ``tool_format``: ``auto`` (the family its
    chat template speaks, tools.family_of) or a family of tools.FAMILIES; the family decides how
    calls are parsed, and how tools and calls are written for templates that ignore them."""

    def __init__(self, tokenizer: Any, tool_format: str = "auto"):
        self.tok = tokenizer
        self.template = tokenizer.chat_template or FALLBACK_TEMPLATE
        if not isinstance(self.template, str):  # a dict of named templates
            self.template = self.template.get("default") or next(iter(self.template.values()))
        self.template_tools = "tools" in self.template
        self.family = family_of(self.template) if tool_format == "auto" else tool_format
        self.eos_ids = {i for i in [tokenizer.eos_token_id] if i is not None}
        # Special tokens dropped from a completion's text: all but the parsers' markers.
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        for i, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            if getattr(added, "special", False):
                special.add(i)
        self.dropped_ids = {i for i in special
                            if tokenizer.convert_ids_to_tokens(i) not in MARKERS}
        # The longest text one token stands for (at most 32): no prompt longer than
        # context * this many characters fits the context, so it is refused before tokenizing.
        self.max_token_chars = 32
        self.max_context = context_length(tokenizer)

    # ---- text ------------------------------------------------------------------------------

    def prepare(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """Messages as the template expects them: text content, and tool calls and tools as
        text where the template cannot render them."""
        out = []
        for m in messages:
            m = {k: v for k, v in canonical(m).items() if k != "tool_calls"} | (
                {"tool_calls": m["tool_calls"]} if m.get("tool_calls") else {})
            if m.get("tool_calls"):
                calls = [{"id": c.get("id") or f"call_{k}", "type": "function",
                          "function": {"name": c["function"]["name"],
                                       "arguments": _parsed(c["function"].get("arguments"))}}
                         for k, c in enumerate(m["tool_calls"])]
                if self.template_tools:
                    m["tool_calls"] = calls
                else:
                    m["content"] = m["content"] + call_text(calls, self.family)
                    del m["tool_calls"]
            out.append(m)
        if tools and not self.template_tools:
            prompt = tools_system_prompt(tools, self.family)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": prompt + "\n\n" + out[0]["content"]}
            else:
                out.insert(0, {"role": "system", "content": prompt})
            tools = None
        return out, (tools or None)

    def text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
             generation: bool) -> str:
        msgs, tools = self.prepare(messages, tools)
        return self.tok.apply_chat_template(msgs, tools=tools, chat_template=self.template,
                                            add_generation_prompt=generation, tokenize=False)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """A completion's text: special tokens dropped except the parsers' markers
        (``<tool_call>``, ``<|python_tag|>``, ``[TOOL_CALLS]``, ``<think>``, ...)."""
        return self.tok.decode([i for i in ids if i not in self.dropped_ids],
                               skip_special_tokens=False)

    def opens_reasoning(self, prompt: list[int]) -> bool:
        """Whether the prompt ends inside ``<think>`` (Qwen3 / DeepSeek-R1 templates open it)."""
        return self.decode(prompt[-8:]).rstrip().endswith(THINK_OPEN)

    # ---- ids -------------------------------------------------------------------------------

    def full(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """A new segment's prompt: the whole conversation and the assistant opener."""
        return self.encode(self.text(messages, tools, generation=True))

    def continuation(self, new: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     last_output_id: int | None) -> list[int] | None:
        """The ids that follow the model's last completion: what the template puts after an
        assistant turn, the ``new`` messages, and the assistant opener. ``last_output_id`` is
        the completion's last token (``None``: empty). None when the template does not render a
        conversation as a prefix of its extension (then the caller renders in full)."""
        base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        try:
            before = self.text(base, tools, generation=False)
            after = self.text(base + list(new), tools, generation=True)
        except Exception:  # a template that raises on this shape (e.g. roles must alternate)
            return None
        if not after.startswith(before) or before.count(_ASSISTANT) != 1:
            return None
        tail = before[before.index(_ASSISTANT) + len(_ASSISTANT):]  # the turn's end marker
        if last_output_id is not None and last_output_id in self.eos_ids:
            # The model wrote the end marker itself when the template ends turns with EOS.
            eos_text = self.tok.decode([last_output_id], skip_special_tokens=False)
            if tail.startswith(eos_text):
                tail = tail[len(eos_text):]
        return self.encode(tail + after[len(before):])


def _parsed(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments or {}
