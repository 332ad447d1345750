"""The gateway: OpenAI's and Anthropic's APIs per session, each turn one generation.

Endpoints (``<base>`` is ``/sessions/<id>/v1`` with the session key as the API key, or ``/v1``
with the run key and the session id in the ``X-Oolong-Session`` header, or, in online mode, with
the run key alone: the session is found or opened by the server, workflows/online.py; on an episode's own
Unix socket any ``/v1`` path is that episode's session):

- ``GET <base>/models``: the one model, the policy being trained;
- ``POST <base>/chat/completions`` (chat_api.py), ``POST <base>/responses`` (responses_api.py),
  ``POST <base>/messages`` (Anthropic, anthropic_api.py): non-streaming, or streamed as the
  tokens are generated.

Every API runs the same turns (turn.py): exact ids across turns, the run's sampling policy
(sampling.py), stop strings, forced tool calls, ``max_tokens`` clamped to min(request,
``rollout.max_new_tokens``, what is left of the episode's ``rollout.agent.max_tokens``, what is
left of the context). The key is checked from the request's head, before its body is read
(http.py). The ``model`` field is not checked (agents written for another model's name work
unchanged).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from training_core.api import InferenceEngine, SamplingParams
from training_core.gateway import anthropic_api, chat_api, responses_api
from training_core.gateway.chat import ChatRenderer
from training_core.gateway.http import (
    LINE_LIMIT,
    EventStream,
    Limits,
    Request,
    Response,
    connection_handler,
    error_response,
)
from training_core.gateway.requests import BadRequest, TurnRequest
from training_core.gateway.session import AgentLimits, Session
from training_core.gateway.turn import Turn, TurnRunner

log = logging.getLogger(__name__)

# An episode's own socket: one agent, a few connections.
UNIX_LIMITS = Limits(max_connections=32, max_per_peer=32)
ENDPOINTS = "/v1/chat/completions, /v1/responses, /v1/messages or /v1/models"


def request_key(headers: dict[str, str]) -> str:
    """The API key: a bearer token (OpenAI) or ``x-api-key`` (Anthropic)."""
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return headers.get("x-api-key", "").strip()


def same_key(given: str, expected: str) -> bool:
    return bool(given) and hmac.compare_digest(given.encode(), expected.encode())


class Gateway:
    def __init__(self, engine: InferenceEngine, renderer: ChatRenderer, sampling: SamplingParams,
                 *, model_name: str = "oolong-policy", run_key: str | None = None,
                 policy: str = "override", max_context: int | None = None,
                 limits: Limits = Limits()):
        self.runner = TurnRunner(engine, renderer, sampling, policy, max_context)
        self.renderer = renderer
        self.sampling = sampling
        self.model_name = model_name
        self.run_key = run_key or "rk-oolong-" + secrets.token_urlsafe(24)
        self.limits = limits
        self.sessions: dict[str, Session] = {}
        self._servers: dict[str, asyncio.AbstractServer] = {}
        self._live: set[asyncio.Task] = set()  # open TCP connections
        self._session_live: dict[str, set[asyncio.Task]] = {}  # open connections per Unix socket
        self.url: str | None = None  # where this process listens
        # Online mode (workflows/online.py): its /rl/* endpoints, and the session of a run-key request
        # that names none.
        self.extra: Callable[[Request], Awaitable[Response]] | None = None
        self.implicit: Callable[[Request, TurnRequest], Awaitable[Session]] | None = None

    @property
    def engine(self) -> InferenceEngine:
        return self.runner.engine

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
        """Listen on TCP (online mode, tests); returns the URL it listens on."""
        server = await asyncio.start_server(
            connection_handler(self.handle, self._live, authorize=self.authorize,
                               limits=self.limits), host, port, limit=LINE_LIMIT)
        self._servers[""] = server
        self.url = f"http://{host}:{server.sockets[0].getsockname()[1]}"
        return self.url

    async def serve_unix(self, session: Session, path: str) -> None:
        """A Unix socket that serves ``session`` only (bound into that episode's jail)."""
        live = self._session_live.setdefault(session.id, set())
        server = await asyncio.start_unix_server(
            connection_handler(partial(self.handle, bound=session), live,
                               authorize=partial(self.authorize, bound=session),
                               limits=UNIX_LIMITS), path, limit=LINE_LIMIT)
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
        self.runner.close()

    # ---- who may ask: decided from the request's head, before its body is read ---------------

    def authorize(self, request: Request, bound: Session | None = None) -> Response | None:
        path = request.path.rstrip("/")
        key = request_key(request.headers)
        request.context["path"] = path
        if path.startswith("/rl/") and bound is None and self.extra is not None:
            if not same_key(key, self.run_key):
                return error_response(401, "wrong run key", param="api_key",
                                      kind="authentication_error")
            return None
        if path.startswith("/sessions/") and bound is None:
            _, _, sid, *rest = path.split("/", 3)
            session = self.sessions.get(sid)
            if session is None:
                return error_response(404, f"no open session {sid!r}", param="session")
            if not (same_key(key, session.key) or same_key(key, self.run_key)):
                return error_response(401, "wrong API key for this session: use the session key",
                                      param="api_key", kind="authentication_error")
            request.context.update(session=session, path="/" + (rest[0] if rest else ""))
        elif bound is not None:
            if not same_key(key, bound.key):
                return error_response(401, "wrong API key for this session: use the api_key the "
                                      "episode was given", param="api_key",
                                      kind="authentication_error")
            request.context["session"] = bound
        else:
            if not same_key(key, self.run_key):
                return error_response(401, "wrong API key: use the run key, or the session key "
                                      "at /sessions/<id>/v1", param="api_key",
                                      kind="authentication_error")
            sid = request.headers.get("x-oolong-session", "")
            if sid:
                session = self.sessions.get(sid)
                if session is None:
                    return error_response(404, f"no open session {sid!r}",
                                          param="X-Oolong-Session")
                request.context["session"] = session
            elif self.implicit is None:
                return error_response(404, "name an open session in the X-Oolong-Session header",
                                      param="X-Oolong-Session")
        return None

    # ---- routing ------------------------------------------------------------------------------

    async def handle(self, request: Request, bound: Session | None = None) -> Response | EventStream:
        if "path" not in request.context:  # called directly (tests): authorize first
            denied = self.authorize(request, bound)
            if denied is not None:
                return denied
        path = request.context["path"]
        if path.startswith("/rl/") and bound is None and self.extra is not None:
            return await self.extra(request)
        anthropic = path == "/v1/messages"
        try:
            return await self._route(request, path)
        except BadRequest as exc:
            if anthropic:
                return anthropic_api.error(exc.status, str(exc), exc.param)
            return error_response(exc.status, str(exc), param=exc.param, code=exc.code,
                                  kind="invalid_request_error" if exc.status < 500
                                  else "server_error")

    async def _route(self, request: Request, path: str) -> Response | EventStream:
        if request.method == "GET" and path == "/v1/models":
            return Response(200, {"object": "list", "data": [self._model_card()]})
        if request.method == "GET" and path == f"/v1/models/{self.model_name}":
            return Response(200, self._model_card())
        apis = ("/v1/chat/completions", "/v1/responses", "/v1/messages")
        if path not in apis:
            raise BadRequest("path", f"no endpoint {request.method} {request.path}: use "
                             + ENDPOINTS, status=404)
        if request.method != "POST":
            raise BadRequest("method", "use POST", status=405)
        try:
            body = request.json()
        except ValueError:
            raise BadRequest("body", "the body is not valid JSON") from None
        session: Session | None = request.context.get("session")

        async def open_turn(req: TurnRequest) -> Turn:
            nonlocal session
            if session is None:
                assert self.implicit is not None
                session = await self.implicit(request, req)
            return await self.runner.start(session, req)

        if path == "/v1/chat/completions":
            return await chat_api.serve(body, open_turn, self.model_name)
        if path == "/v1/messages":
            return await anthropic_api.serve(body, open_turn, self.model_name)
        return await responses_api.serve(body, partial(self._previous, session), open_turn,
                                         self.model_name)

    def _previous(self, session: Session | None, response_id: str) -> list[dict[str, Any]]:
        """The conversation of an earlier response (Responses API's previous_response_id): of
        this session, or of any open one when the session is found by the server."""
        candidates = [session] if session is not None else list(self.sessions.values())
        for s in candidates:
            if response_id in s.responses:
                return s.responses[response_id]
        raise BadRequest("previous_response_id", f"no response resp_{response_id} in this "
                         "session (only the last few responses are kept)", status=400)

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "oolong"}
