"""Online mode (``rollout.mode: online``): agents that run elsewhere, in any language.

The trainer serves the gateway on TCP (``rollout.agent.gateway_host``/``gateway_port``) and
writes its URL and run key to ``gateway.json`` in the run directory (mode 0600; the key is never
logged). An external client, with the run key as bearer token:

1. ``POST /rl/sessions`` ``{"group": <id, optional>, "item": {...}}`` opens an episode and gets
   ``{"id", "api_key", "base_url", "group"}``. The ``group`` ties the G
   (``rollout.group_size``) episodes of one task together for the group baseline: the first
   session of a group leaves ``group`` out and the others send the id it got. A new group is
   admitted only when the staleness bound has room (the same admission as any episode, before
   its first token); otherwise 429 with ``code: no_capacity`` (retry after a second).
2. Calls ``<base_url>/chat/completions`` with ``api_key`` (any OpenAI client).
3. ``POST /rl/sessions/<id>/reward`` ``{"reward": 1.0}`` (or one per completion) ends the
   episode; ``POST /rl/sessions/<id>/fail`` ``{"reason": ...}`` gives it up. A group enters the
   batch when all its episodes have ended; a failed episode drops its group (never scored 0), as
   does a group not finished within ``rollout.agent.timeout_s`` of its first session.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training_core.api import EpisodeError, InferenceEngine, TrajectoryGroup
from training_core.gateway.chat import ChatRenderer
from training_core.gateway.credit import BadReward, episode_trajectories
from training_core.gateway.http import Request, Response, error_response
from training_core.gateway.server import Gateway
from training_core.gateway.session import AgentLimits, Session
from training_core.workflows.base import WorkflowContext

log = logging.getLogger(__name__)

RUN_KEY_ENV = "OOLONG_GATEWAY_KEY"  # the platform may hand the run key in; else one is made


@dataclass
class _Slot:
    """One admitted group: the executor's episode waiting for G external episodes."""

    size: int
    done: asyncio.Future
    id: str = field(default_factory=lambda: secrets.token_hex(6))
    sessions: list[Session] = field(default_factory=list)
    rows: dict[int, list] = field(default_factory=dict)
    taken: asyncio.Event = field(default_factory=asyncio.Event)


class OnlineWorkflow:
    def __init__(self, ctx: WorkflowContext):
        self.ctx = ctx
        settings = ctx.agent
        self.limits = AgentLimits(settings.max_turns, settings.max_tokens, settings.timeout_s)
        self.discount = settings.discount
        self.host, self.port = settings.gateway_host, settings.gateway_port
        self.file = settings.gateway_file
        self.run_key = settings.gateway_key  # issued by the web app for its runs
        self.renderer = ChatRenderer(ctx.tokenizer, settings.tool_format)
        self.gateway: Gateway | None = None
        self.on_ready: Callable[[str], None] | None = None  # called with the URL (never the key)
        self._starting = asyncio.Lock()
        self._free: list[_Slot] = []  # admitted, no session yet
        self._groups: dict[str, _Slot] = {}  # taken, still open
        self._by_session: dict[str, tuple[_Slot, int]] = {}

    async def start(self, engine: InferenceEngine) -> Gateway:
        async with self._starting:  # episodes start concurrently: one gateway for all
            if self.gateway is None:
                await self._start(engine)
        assert self.gateway is not None
        return self.gateway

    async def _start(self, engine: InferenceEngine) -> None:
        if self.gateway is None:
            gateway = Gateway(engine, self.renderer, self.ctx.sampling,
                              run_key=self.run_key or os.environ.get(RUN_KEY_ENV) or None)
            gateway.extra = self.handle
            url = await gateway.start_tcp(self.host, self.port)
            if self.file:  # atomically: a client polling for it never reads half of it
                path = Path(self.file)
                tmp = path.with_name(path.name + ".tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump({"url": url, "run_key": gateway.run_key}, f)
                os.replace(tmp, path)
            log.info("online gateway at %s (run key in %s)", url, self.file or "nowhere")
            if self.on_ready is not None:
                self.on_ready(url)
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
            for session in slot.sessions:
                self._by_session.pop(session.id, None)
                await self.gateway.close_session(session)

    # ---- the /rl endpoints ----------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        assert self.gateway is not None
        key = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if key != self.gateway.run_key:
            return error_response(401, "wrong run key", param="api_key",
                                  kind="authentication_error")
        try:
            body = request.json() or {}
        except ValueError:
            return error_response(400, "the body is not valid JSON", param="body")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object", param="body")
        parts = request.path.rstrip("/").split("/")  # ["", "rl", "sessions", id, action]
        if request.method == "POST" and parts == ["", "rl", "sessions"]:
            return self._open(body)
        if request.method == "POST" and len(parts) == 5 and parts[2] == "sessions":
            if parts[4] == "reward":
                return self._reward(parts[3], body)
            if parts[4] == "fail":
                return self._fail(parts[3], str(body.get("reason", "given up by the client"))[:500])
        return error_response(404, f"no endpoint {request.method} {request.path}: use POST "
                              "/rl/sessions, /rl/sessions/<id>/reward or /rl/sessions/<id>/fail",
                              param="path")

    def _open(self, body: dict[str, Any]) -> Response:
        group = body.get("group")
        item = body.get("item")
        if item is not None and not isinstance(item, dict):
            return error_response(400, "item must be a JSON object", param="item")
        if group is None:
            if not self._free:
                return error_response(429, "no capacity: the staleness bound admits no new group "
                                      "now; retry in a second", code="no_capacity")
            slot = self._free.pop(0)
            self._groups[slot.id] = slot
            slot.taken.set()
        else:
            slot = self._groups.get(str(group))
            if slot is None:
                return error_response(404, f"no open group {group!r}: leave group out to start one",
                                      param="group")
            if len(slot.sessions) >= slot.size:
                return error_response(409, f"group {group!r} already has its {slot.size} episodes "
                                      "(rollout.group_size)", param="group")
        session = self.gateway.open_session(self.limits, item)
        self._by_session[session.id] = (slot, len(slot.sessions))
        slot.sessions.append(session)
        return Response(201, {"id": session.id, "api_key": session.key, "group": slot.id,
                              "group_size": slot.size,
                              "base_url": f"{self.gateway.url}/sessions/{session.id}/v1"})

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
        if len(slot.rows) == slot.size and not slot.done.done():
            slot.done.set_result(TrajectoryGroup(
                samples=[r for k in sorted(slot.rows) for r in slot.rows[k]]))
        return Response(200, {"id": sid, "accepted": True,
                              "episode_return": slot.rows[episode][0].info["episode_return"]})

    def _fail(self, sid: str, reason: str) -> Response:
        found = self._by_session.get(sid)
        if found is None:
            return error_response(404, f"no open session {sid!r}", param="session")
        slot, _ = found
        if not slot.done.done():
            slot.done.set_exception(EpisodeError(f"online group {slot.id} dropped: {reason}"))
        return Response(200, {"id": sid, "dropped_group": slot.id})
