"""OpenAI's ``POST /v1/chat/completions``: the request as a turn, the answer as a
``chat.completion`` or, streamed, as ``chat.completion.chunk`` events sent while the tokens are
generated."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from training_core.gateway.http import EventStream, Response
from training_core.gateway.requests import chat_request
from training_core.gateway.sampling import OVERRIDDEN_HEADER
from training_core.gateway.turn import Answer, Delta, Turn

SESSION_HEADER = "X-Oolong-Session"


def message(answer: Answer) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.reasoning:
        out["reasoning_content"] = answer.reasoning  # as SGLang, vLLM and DeepSeek name it
    if answer.tool_calls:
        out["tool_calls"] = answer.tool_calls
    return out


def usage(answer: Answer) -> dict[str, Any]:
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
            "total_tokens": answer.prompt_tokens + answer.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": answer.cached_tokens}}


def logprobs(answer: Answer) -> dict[str, Any]:
    return {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                        for t, lp in answer.logprobs]}


def completion(answer: Answer, model: str, with_logprobs: bool) -> dict[str, Any]:
    return {"id": "chatcmpl-" + answer.id, "object": "chat.completion",
            "created": answer.created, "model": model,
            "choices": [{"index": 0, "message": message(answer), "finish_reason": answer.finish,
                         "logprobs": logprobs(answer) if with_logprobs else None}],
            "usage": usage(answer)}


async def serve(body: Any, open_turn: Any, model: str) -> Response | EventStream:
    """``open_turn(turn_request) -> Turn`` finds the session and starts the turn."""
    req = chat_request(body)
    turn: Turn = await open_turn(req)
    if not req.stream:
        answer = await turn.run()
        return Response(200, completion(answer, model, req.logprobs), turn_headers(turn))
    events = turn.stream()
    try:
        first = await anext(events)  # a refused prompt is still a plain 4xx
    except BaseException:
        await events.aclose()
        raise
    return EventStream(_chunks(turn, first, events, model, req.include_usage, req.logprobs),
                       headers=turn_headers(turn), close=events.aclose)


def turn_headers(turn: Turn) -> dict[str, str]:
    """The session (online mode's implicit sessions are named here) and what the run's sampling
    policy overrode."""
    headers = {SESSION_HEADER: turn.session.id}
    if turn.decision.overridden:
        headers[OVERRIDDEN_HEADER] = ",".join(turn.decision.overridden)
    return headers


async def _chunks(turn: Turn, first: Delta | Answer, events: AsyncIterator[Delta | Answer],
                  model: str, include_usage: bool, with_logprobs: bool) -> AsyncIterator[Any]:
    base = {"id": "chatcmpl-" + turn.id, "object": "chat.completion.chunk",
            "created": turn.created, "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return base | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                    "logprobs": extra.get("logprobs")}]}

    async with contextlib.aclosing(events):
        yield chunk({"role": "assistant", "content": ""})
        item = first
        while True:
            if isinstance(item, Delta):
                key = "reasoning_content" if item.kind == "reasoning" else "content"
                yield chunk({key: item.text})
            else:
                answer = item
                for i, call in enumerate(answer.tool_calls):
                    yield chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                                 "function": call["function"]}]})
                yield chunk({}, answer.finish,
                            logprobs=logprobs(answer) if with_logprobs else None)
                if include_usage:
                    yield base | {"choices": [], "usage": usage(answer)}
                yield "[DONE]"
                return
            item = await anext(events)
