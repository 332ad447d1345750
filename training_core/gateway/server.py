"""The gateway: OpenAI's chat completions API per session, each call one ``agenerate``.

Endpoints (``<base>`` is ``/sessions/<id>/v1`` with the session key as the API key, or ``/v1``
with the run key and the session id in the ``X-Oolong-Session`` header; on an episode's own Unix
socket any ``/v1`` path is that episode's session):

- ``GET <base>/models``: the one model, the policy being trained;
- ``POST <base>/chat/completions``: non-streaming, or streaming (``stream: true``) as server-sent
  events. The completion is generated whole by the rollout servers (the ``agenerate`` path that
  survives weight updates), then sent as chunks: a stream's first content byte arrives when
  generation ends.

Sampling is the run's: ``n`` must be 1, ``temperature`` and ``top_p`` absent or the run's values,
``stop``, ``logit_bias``, penalties, ``top_logprobs``, forced tool choice and structured output
are refused with a 400 naming the field. ``max_tokens`` / ``max_completion_tokens`` are clamped:
a turn samples at most min(request, ``rollout.max_new_tokens``, what is left of the episode's
``rollout.agent.max_tokens``). The ``model`` field is not checked (agents written for another
model's name work unchanged).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import Any

from training_core.api import EpisodeError, GenerationRequest, InferenceEngine, SamplingParams
from training_core.gateway.chat import ChatRenderer, canonical
from training_core.gateway.http import (
    EventStream,
    Request,
    Response,
    connection_handler,
    error_response,
)
from training_core.gateway.session import AgentLimits, Segment, Session, SessionFailed
from training_core.gateway.tools import Parsed, parse_tool_calls

log = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")


class BadRequest(Exception):
    def __init__(self, param: str | None, message: str, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class Gateway:
    def __init__(self, engine: InferenceEngine, renderer: ChatRenderer, sampling: SamplingParams,
                 *, model_name: str = "oolong-policy", run_key: str | None = None):
        self.engine = engine
        self.renderer = renderer
        self.sampling = sampling
        self.model_name = model_name
        self.run_key = run_key or "rk-oolong-" + secrets.token_urlsafe(24)
        self.sessions: dict[str, Session] = {}
        self._servers: dict[str, asyncio.AbstractServer] = {}
        self._live: set[asyncio.Task] = set()  # open TCP connections
        self._session_live: dict[str, set[asyncio.Task]] = {}  # open connections per Unix socket
        self.url: str | None = None
        # Online mode's /rl/* endpoints (online.py), on the TCP listener only.
        self.extra: Callable[[Request], Awaitable[Response]] | None = None

    # ---- sessions and listeners ---------------------------------------------------------------

    def open_session(self, limits: AgentLimits = AgentLimits(),
                     item: dict[str, Any] | None = None) -> Session:
        session = Session.new(limits, item)
        self.sessions[session.id] = session
        return session

    async def close_session(self, session: Session) -> None:
        self.sessions.pop(session.id, None)
        server = self._servers.pop(session.id, None)
        if server is not None:
            server.close()
        live = self._session_live.pop(session.id, set())
        for task in live:  # connections of a killed jail
            task.cancel()
        await asyncio.gather(*live, return_exceptions=True)

    async def start_tcp(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on TCP (tests, clients outside the jail); returns the base URL."""
        server = await asyncio.start_server(connection_handler(self.handle, self._live), host, port)
        self._servers[""] = server
        self.url = f"http://{host}:{server.sockets[0].getsockname()[1]}"
        return self.url

    async def serve_unix(self, session: Session, path: str) -> None:
        """A Unix socket that serves ``session`` only (bound into that episode's jail)."""
        live = self._session_live.setdefault(session.id, set())
        server = await asyncio.start_unix_server(
            connection_handler(partial(self.handle, bound=session), live), path)
        # The socket lies in the jail's private scratch directory, which guards it; the jail's
        # user must be able to connect.
        os.chmod(path, 0o666)
        self._servers[session.id] = server

    async def aclose(self) -> None:
        for server in list(self._servers.values()):
            server.close()
        self._servers.clear()
        live = set(self._live).union(*self._session_live.values())
        for task in live:
            task.cancel()
        await asyncio.gather(*live, return_exceptions=True)

    # ---- routing ------------------------------------------------------------------------------

    async def handle(self, request: Request, bound: Session | None = None) -> Response | EventStream:
        path = request.path.rstrip("/")
        if path.startswith("/rl/") and bound is None and self.extra is not None:
            return await self.extra(request)
        key = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if path.startswith("/sessions/"):
            _, _, sid, *rest = path.split("/", 3)
            session = self.sessions.get(sid)
            if session is None or (bound is not None and session is not bound):
                return error_response(404, f"no open session {sid!r}", param="session")
            if key not in (session.key, self.run_key):
                return error_response(401, "wrong API key for this session: use the session key",
                                      param="api_key", kind="authentication_error")
            path = "/" + (rest[0] if rest else "")
        elif bound is not None:
            session = bound
            if key != session.key:
                return error_response(401, "wrong API key for this session: use the api_key the "
                                      "episode was given", param="api_key",
                                      kind="authentication_error")
        else:
            sid = request.headers.get("x-oolong-session", "")
            if key != self.run_key:
                return error_response(401, "wrong API key: use the run key, or the session key "
                                      "at /sessions/<id>/v1", param="api_key",
                                      kind="authentication_error")
            session = self.sessions.get(sid)
            if session is None:
                return error_response(404, "name an open session in the X-Oolong-Session header",
                                      param="X-Oolong-Session")
        if path == "/v1/models" and request.method == "GET":
            return Response(200, {"object": "list", "data": [self._model_card()]})
        if path == f"/v1/models/{self.model_name}" and request.method == "GET":
            return Response(200, self._model_card())
        if path == "/v1/chat/completions":
            if request.method != "POST":
                return error_response(405, "use POST", param="method")
            try:
                body = request.json()
            except ValueError:
                return error_response(400, "the body is not valid JSON", param="body")
            try:
                return await self.chat(session, body)
            except BadRequest as exc:
                return error_response(exc.status, str(exc), param=exc.param, code=exc.code)
        return error_response(404, f"no endpoint {request.method} {request.path}: use "
                              "/v1/chat/completions or /v1/models", param="path")

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "oolong"}

    # ---- chat completions ---------------------------------------------------------------------

    async def chat(self, session: Session, body: Any) -> Response | EventStream:
        req = validate(body, self.sampling)
        async with session.lock:
            try:
                budget = session.budget(req["max_tokens"], self.sampling.max_new_tokens)
            except SessionFailed as exc:
                raise BadRequest(None, str(exc), status=429, code="episode_limit") from None
            prompt, new = self._prompt(session, req["messages"], req["tools"])
            sampling = replace(self.sampling, max_new_tokens=budget)
            try:
                resp = await self.engine.agenerate(GenerationRequest(prompt, sampling))
            except EpisodeError as exc:
                session.fail(f"generation failed: {exc}")
                raise BadRequest("messages", f"generation failed: {exc}") from None
            except Exception as exc:  # the servers are down: the run fails, not this episode
                session.fatal = exc
                session.fail(f"rollout servers failed: {exc}")
                raise BadRequest(None, "rollout servers unavailable", status=503) from None
            turn = session.turns
            session.turns += 1
            session.sampled_tokens += len(resp.output_ids)
            session.interruptions += resp.interruptions
            session.segments[-1].add_output(resp, turn)
            session.last_output_id = resp.output_ids[-1] if resp.output_ids else None
            text = self.renderer.tok.decode(resp.output_ids, skip_special_tokens=True)
            parsed = parse_tool_calls(text) if req["tools"] else Parsed(text)
            session.tool_parse_failures += parsed.failed
            session.tool_calls += len(parsed.tool_calls)
            finish = ("tool_calls" if parsed.tool_calls else
                      "length" if resp.finish_reason == "length" else "stop")
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if parsed.tool_calls:
                message["tool_calls"] = parsed.tool_calls
            session.history = [canonical(m) for m in req["messages"]] + [canonical(message)]
            session.log.append({"turn": turn, "segment": len(session.segments) - 1,
                                "new_messages": new, "completion": text,
                                "tool_calls": parsed.tool_calls, "finish_reason": finish,
                                "versions": sorted(set(resp.output_versions)),
                                "tool_parse_failed": parsed.failed})
        completion = {
            "id": "chatcmpl-" + secrets.token_hex(12), "object": "chat.completion",
            "created": int(time.time()), "model": self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": self._logprobs(resp) if req["logprobs"] else None}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(resp.output_ids),
                      "total_tokens": len(prompt) + len(resp.output_ids)},
        }
        if req["stream"]:
            return EventStream(_chunks(completion, req["include_usage"]))
        return Response(200, completion)

    def _prompt(self, session: Session, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None) -> tuple[list[int], list[dict[str, Any]]]:
        """The next prompt's ids and the messages new to the model; appends the ids to the session's current segment or opens a new
        one (see the module doc of session.py). Under the session's lock."""
        tools_key = json.dumps(tools, sort_keys=True)
        old = session.history
        extends = (old is not None and session.segments and tools_key == session.tools_key
                   and len(messages) > len(old)
                   and [canonical(m) for m in messages[: len(old)]] == old)
        session.tools_key = tools_key
        if extends:
            delta = self.renderer.continuation(messages[len(old):], tools, session.last_output_id)
            if delta is not None:
                seg = session.segments[-1]
                seg.add_prompt(delta)
                return list(seg.ids), [canonical(m) for m in messages[len(old):]]
        ids = self.renderer.full(messages, tools)
        session.forks += bool(session.segments)
        session.segments.append(Segment.from_prompt(ids))
        return ids, [canonical(m) for m in messages]

    def _logprobs(self, resp) -> dict[str, Any]:
        tok = self.renderer.tok
        return {"content": [{"token": tok.decode([t], skip_special_tokens=False), "logprob": lp,
                             "bytes": None, "top_logprobs": []}
                            for t, lp in zip(resp.output_ids, resp.output_logprobs, strict=True)]}


def validate(body: Any, sampling: SamplingParams) -> dict[str, Any]:
    """The request's fields the gateway uses; 400 naming the field for anything else it cannot
    honour (see the module doc)."""
    if not isinstance(body, dict):
        raise BadRequest("body", "the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "messages must be a non-empty list of chat messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}].role", f"each message needs a role, one of {ROLES}")
        if m["role"] == "developer":  # OpenAI's newer name for the system role
            messages[i] = {**m, "role": "system"}
    if body.get("n", 1) not in (1, None):
        raise BadRequest("n", "n must be 1: each completion is one turn of one episode (the run's "
                         "group size sets how many episodes each task gets)")
    for name, value in (("temperature", sampling.temperature), ("top_p", sampling.top_p)):
        got = body.get(name)
        if got is not None and (not isinstance(got, int | float) or abs(got - value) > 1e-6):
            raise BadRequest(name, f"{name} is fixed by the run at {value} (rollout.{name}): "
                             "leave it out or send that value")
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise BadRequest(name, f"{name} changes the sampled distribution: leave it out")
    if body.get("logit_bias"):
        raise BadRequest("logit_bias", "logit_bias changes the sampled distribution: leave it out")
    if body.get("stop"):
        raise BadRequest("stop", "stop sequences are not supported: the run stops at the model's "
                         "end-of-turn token; leave stop out")
    if body.get("top_logprobs"):
        raise BadRequest("top_logprobs", "top_logprobs is not supported: leave it out")
    fmt = body.get("response_format")
    if fmt and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise BadRequest("response_format", "structured output is not supported: leave "
                         "response_format out")
    tools = body.get("tools") or None
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and isinstance(t.get("function", {}).get("name"), str)
                for t in tools):
            raise BadRequest("tools", "tools must be a list of {type: function, function: {name, "
                             "description, parameters}}")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise BadRequest("tool_choice", "tool_choice must be auto or none: a forced call would "
                         "change what the model samples")
    if choice == "none":
        tools = None
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise BadRequest("max_tokens", "max_tokens must be a positive integer")
    options = body.get("stream_options") or {}
    return {"messages": messages, "tools": tools, "max_tokens": max_tokens,
            "stream": bool(body.get("stream")), "logprobs": bool(body.get("logprobs")),
            "include_usage": bool(isinstance(options, dict) and options.get("include_usage"))}


async def _chunks(completion: dict[str, Any], include_usage: bool) -> AsyncIterator[Any]:
    """A finished completion as OpenAI's stream of ``chat.completion.chunk`` events."""
    choice = completion["choices"][0]
    message = choice["message"]
    base = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return base | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                    "logprobs": extra.get("logprobs")}]}

    yield chunk({"role": "assistant", "content": ""})
    if message.get("content"):
        yield chunk({"content": message["content"]}, logprobs=choice["logprobs"])
    for i, call in enumerate(message.get("tool_calls", [])):
        yield chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                     "function": call["function"]}]})
    yield chunk({}, choice["finish_reason"])
    if include_usage:
        yield base | {"choices": [], "usage": completion["usage"]}
    yield "[DONE]"
