"""Online mode (``rollout.mode: online``): agents that run elsewhere, in any language.

The trainer serves the gateway on TCP (``rollout.agent.gateway_host``/``gateway_port``,
administrator fields) and writes its URL and run key to ``<run_dir>/gateway.json`` (mode 0600,
never through a symlink; the key is never logged). The URL is ``rollout.agent.public_url`` when
set (a TLS proxy in front), else ``http://<this host's name>:<port>``, never ``0.0.0.0``.

**One URL and one key per run.** Point any agent at ``<url>/v1`` with the run key as its API key
(OpenAI chat completions or responses, Anthropic messages). The server finds each request's
episode:

- a request whose messages extend an open episode's conversation (its last request and the
  answer it got) continues that episode (the longest such; equal candidates are identical so
  far, and the least recently active is taken);
- any other request opens a new episode. Episodes are grouped for the group baseline: those
  whose first request has the same messages and tools (the same task), or the same
  ``X-Oolong-Group`` header when the client sends one, fill a group of ``rollout.group_size``;
  the next one starts a new group. A new group is admitted only when the staleness bound has
  room, else 429 ``no_capacity`` (retry).
- Each answer names its episode in the ``X-Oolong-Session`` header. The client ends it with
  ``POST /rl/reward {"response_id": <any answer id of it>, "reward": ...}`` (or
  ``/rl/sessions/<id>/reward``); a group enters the batch when all its episodes have rewards.

**Explicit sessions** (as before): ``POST /rl/sessions {"group": <optional>, "item": {...}}``
returns ``{"id", "api_key", "base_url", "group", "group_size"}``; the first of a group leaves
``group`` out, the others send the id it got; ``POST /rl/sessions/<id>/reward`` or ``/fail``.

A failed episode drops its group (never scored 0), as does a group not finished within
``rollout.agent.timeout_s`` of its first episode.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training_core.api import EpisodeError, InferenceEngine, TrajectoryGroup
from training_core.gateway.chat import ChatRenderer, canonical
from training_core.gateway.credit import BadReward, episode_trajectories
from training_core.gateway.http import Request, Response, error_response
from training_core.gateway.requests import BadRequest, TurnRequest
from training_core.gateway.server import Gateway
from training_core.gateway.session import AgentLimits, Session
from training_core.workflows.base import WorkflowContext

log = logging.getLogger(__name__)

RUN_KEY_ENV = "OOLONG_GATEWAY_KEY"  # the platform may hand the run key in; else one is made
GROUP_HEADER = "x-oolong-group"
ANSWER_PREFIXES = ("chatcmpl-", "resp_", "msg_")


@dataclass
class _Slot:
    """One admitted group: the executor's episode waiting for G external episodes."""

    size: int
    done: asyncio.Future
    id: str = field(default_factory=lambda: secrets.token_hex(6))
    sessions: list[Session] = field(default_factory=list)
    rows: dict[int, list] = field(default_factory=dict)
    taken: asyncio.Event = field(default_factory=asyncio.Event)
    key: str | None = None  # implicit groups: what their episodes' first requests share


def public_url(host: str, port: int, configured: str = "") -> str:
    """What a client on another host uses: the configured URL, else this host's name for a
    wildcard address."""
    if configured:
        return configured.rstrip("/")
    if host in ("", "0.0.0.0", "::"):
        host = socket.getfqdn()
    return f"http://{host}:{port}"


def write_gateway_file(path: Path, url: str, run_key: str) -> None:
    """``{"url", "run_key"}`` at ``path``, 0600, atomically; a symlink is replaced, never
    followed (the temporary file is created with O_EXCL | O_NOFOLLOW)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "run_key": run_key}, f)
    os.replace(tmp, path)  # rename replaces a link at ``path`` itself


class OnlineWorkflow:
    def __init__(self, ctx: WorkflowContext):
        self.ctx = ctx
        settings = ctx.agent
        self.limits = AgentLimits(settings.max_turns, settings.max_tokens, settings.timeout_s)
        self.discount = settings.discount
        self.host, self.port = settings.gateway_host, settings.gateway_port
        self.configured_url = getattr(settings, "public_url", "")
        self.policy = getattr(settings, "sampling", "override")
        # Where the URL and key are written: <run_dir>/gateway.json, set by the run (never a
        # spec field: no member names a host path). None: nowhere.
        self.file: Path | None = None
        self.run_key = settings.gateway_key  # issued by the web app for its runs
        self.renderer = ChatRenderer(ctx.tokenizer, settings.tool_format)
        self.gateway: Gateway | None = None
        self.url: str | None = None
        self.on_ready: Callable[[str], None] | None = None  # called with the URL (never the key)
        self._starting = asyncio.Lock()
        self._free: list[_Slot] = []  # admitted, no session yet
        self._groups: dict[str, _Slot] = {}  # taken, still open
        self._by_session: dict[str, tuple[_Slot, int]] = {}
        self._implicit: dict[str, _Slot] = {}  # group key -> the group filling now

    async def start(self, engine: InferenceEngine) -> Gateway:
        async with self._starting:  # episodes start concurrently: one gateway for all
            if self.gateway is None:
                await self._start(engine)
        assert self.gateway is not None
        return self.gateway

    async def _start(self, engine: InferenceEngine) -> None:
        gateway = Gateway(engine, self.renderer, self.ctx.sampling, policy=self.policy,
                          run_key=self.run_key or os.environ.get(RUN_KEY_ENV) or None)
        gateway.extra = self.handle
        gateway.implicit = self._session_for
        listening = await gateway.start_tcp(self.host, self.port)
        self.url = public_url(self.host, int(listening.rsplit(":", 1)[1]), self.configured_url)
        if self.file is not None:
            write_gateway_file(self.file, self.url, gateway.run_key)
        log.info("online gateway at %s (run key in %s)", self.url, self.file or "nowhere")
        if self.on_ready is not None:
            self.on_ready(self.url)
        self.gateway = gateway

    async def arun_episode(self, engine: InferenceEngine, item: dict[str, Any]) -> TrajectoryGroup | None:
        """Admitted by the executor (the staleness bound had room): wait for a client to take
        this slot, then for the group's G episodes to end."""
        await self.start(engine)
        slot = _Slot(self.ctx.group_size, asyncio.get_running_loop().create_future())
        self._free.append(slot)
        try:
            await slot.taken.wait()
            try:
                return await asyncio.wait_for(asyncio.shield(slot.done), self.limits.timeout_s)
            except TimeoutError:
                raise EpisodeError(f"online group {slot.id} not finished within "
                                   f"{self.limits.timeout_s:g} s (rollout.agent.timeout_s): "
                                   "dropped") from None
        except asyncio.CancelledError:  # only when the executor stops: the run is over
            await self.gateway.aclose()
            raise
        finally:
            if slot in self._free:
                self._free.remove(slot)
            self._groups.pop(slot.id, None)
            if slot.key is not None and self._implicit.get(slot.key) is slot:
                del self._implicit[slot.key]
            for session in slot.sessions:
                self._by_session.pop(session.id, None)
                await self.gateway.close_session(session)

    # ---- groups and sessions -----------------------------------------------------------------

    def _take(self) -> _Slot:
        if not self._free:
            raise BadRequest(None, "no capacity: the staleness bound admits no new group now; "
                             "retry in a second", status=429, code="no_capacity")
        slot = self._free.pop(0)
        self._groups[slot.id] = slot
        slot.taken.set()
        return slot

    def _join(self, slot: _Slot, item: dict[str, Any] | None) -> Session:
        assert self.gateway is not None
        session = self.gateway.open_session(self.limits, item)
        session.group = slot.id
        self._by_session[session.id] = (slot, len(slot.sessions))
        slot.sessions.append(session)
        if slot.key is not None and len(slot.sessions) >= slot.size:
            self._implicit.pop(slot.key, None)  # full: the next such episode starts a group
        return session

    def _open_episode(self, session: Session) -> bool:
        found = self._by_session.get(session.id)
        return (found is not None and found[1] not in found[0].rows and session.failure is None
                and not found[0].done.done())

    async def _session_for(self, request: Request, req: TurnRequest) -> Session:
        """The episode of a run-key request that names none (module doc)."""
        canon = [canonical(m) for m in req.messages]
        candidates = []
        for sid in list(self._by_session):
            s = self.gateway.sessions.get(sid) if self.gateway else None
            if s is None or s.history is None or not self._open_episode(s):
                continue
            if len(s.history) < len(canon) and canon[: len(s.history)] == s.history:
                candidates.append(s)
        # The longest conversation it extends; among equals one not busy, least recently used.
        best = max(candidates, default=None,
                   key=lambda s: (len(s.history or []), not s.lock.locked(), -s.last_active))
        if best is not None:
            return best
        named = request.headers.get(GROUP_HEADER, "")
        key = "header:" + named if named else json.dumps([canon, req.tools], sort_keys=True)
        slot = self._implicit.get(key)
        if slot is None or len(slot.sessions) >= slot.size:
            slot = self._take()
            slot.key = key
            self._implicit[key] = slot
        return self._join(slot, None)

    # ---- the /rl endpoints ----------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        assert self.gateway is not None  # the run key was checked from the request's head
        try:
            body = request.json() or {}
        except ValueError:
            return error_response(400, "the body is not valid JSON", param="body")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object", param="body")
        parts = request.path.rstrip("/").split("/")  # ["", "rl", "sessions", id, action]
        try:
            if request.method == "POST" and parts == ["", "rl", "sessions"]:
                return self._open(body, request)
            if request.method == "POST" and parts == ["", "rl", "reward"]:
                return self._reward(self._answered(body.get("response_id")), body)
            if request.method == "POST" and len(parts) == 5 and parts[2] == "sessions":
                if parts[4] == "reward":
                    return self._reward(parts[3], body)
                if parts[4] == "fail":
                    return self._fail(parts[3], str(body.get("reason", "given up by the "
                                                             "client"))[:500])
        except BadRequest as exc:
            return error_response(exc.status, str(exc), param=exc.param, code=exc.code)
        return error_response(404, f"no endpoint {request.method} {request.path}: use POST "
                              "/rl/sessions, /rl/reward, /rl/sessions/<id>/reward or "
                              "/rl/sessions/<id>/fail", param="path")

    def _answered(self, response_id: Any) -> str:
        """The session that gave the answer ``response_id`` (any API's id)."""
        if not isinstance(response_id, str) or not response_id:
            raise BadRequest("response_id", "name an answer: the id of a chat completion, "
                             "response or message the episode got")
        rid = response_id
        for prefix in ANSWER_PREFIXES:
            rid = rid.removeprefix(prefix)
        for sid in self._by_session:
            s = self.gateway.sessions.get(sid) if self.gateway else None
            if s is not None and rid in s.completion_ids:
                return sid
        raise BadRequest("response_id", f"no open episode gave the answer {response_id!r}",
                         status=404)

    def _base_url(self, request: Request) -> str:
        """Sessions' base URL as the client reached the gateway (its Host header) unless a public
        URL is configured."""
        if self.configured_url or not request.headers.get("host"):
            return self.url or ""
        scheme = request.headers.get("x-forwarded-proto", "http").split(",")[0].strip()
        return f"{scheme if scheme in ('http', 'https') else 'http'}://{request.headers['host']}"

    def _open(self, body: dict[str, Any], request: Request) -> Response:
        group = body.get("group")
        item = body.get("item")
        if item is not None and not isinstance(item, dict):
            return error_response(400, "item must be a JSON object", param="item")
        if group is None:
            slot = self._take()
        else:
            slot = self._groups.get(str(group))
            if slot is None:
                return error_response(404, f"no open group {group!r}: leave group out to start one",
                                      param="group")
            if len(slot.sessions) >= slot.size:
                return error_response(409, f"group {group!r} already has its {slot.size} episodes "
                                      "(rollout.group_size)", param="group")
        session = self._join(slot, item)
        return Response(201, {"id": session.id, "api_key": session.key, "group": slot.id,
                              "group_size": slot.size,
                              "base_url": f"{self._base_url(request)}/sessions/{session.id}/v1"})

    def _reward(self, sid: str, body: dict[str, Any]) -> Response:
        found = self._by_session.get(sid)
        if found is None:
            return error_response(404, f"no open session {sid!r}", param="session")
        slot, episode = found
        session = slot.sessions[episode]
        if episode in slot.rows:
            return error_response(409, "this session already has its reward", param="session")
        if session.failure is not None:
            return self._fail(sid, session.failure)
        try:
            slot.rows[episode] = episode_trajectories(session, body.get("reward"), episode=episode,
                                                      discount=self.discount)
        except BadReward as exc:
            return error_response(400, str(exc), param="reward")
        session.last_active = time.monotonic()
        if len(slot.rows) == slot.size and not slot.done.done():
            slot.done.set_result(TrajectoryGroup(
                samples=[r for k in sorted(slot.rows) for r in slot.rows[k]]))
        return Response(200, {"id": sid, "accepted": True, "group": slot.id,
                              "group_size": slot.size, "group_complete": len(slot.rows) == slot.size,
                              "episode_return": slot.rows[episode][0].info["episode_return"]})

    def _fail(self, sid: str, reason: str) -> Response:
        found = self._by_session.get(sid)
        if found is None:
            return error_response(404, f"no open session {sid!r}", param="session")
        slot, _ = found
        if not slot.done.done():
            slot.done.set_exception(EpisodeError(f"online group {slot.id} dropped: {reason}"))
        return Response(200, {"id": sid, "dropped_group": slot.id})
