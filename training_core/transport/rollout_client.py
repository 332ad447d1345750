"""Async client for SGLang's native HTTP API over N rollout servers.

- Least-in-flight routing; a server that fails a request is skipped for a cool-down.
- Timeouts and retries on connection errors and 5xx (another server is tried).
- Interruptible generation (``pause_mode="abort"``, AReaL's): a request that comes back with
  finish reason ``abort`` *because the trainer paused the servers* (this client sent
  ``/pause_generation`` while it was in flight) is re-submitted once generation continues, with
  its partial output appended to the prompt, so one sequence can span several policy versions and
  its KV cache is recomputed with the new weights. Every output token keeps the version that
  produced it and its behaviour logprob. Re-submission stops when the token budget is spent, and a
  sample interrupted more than ``max_interruptions`` times fails its episode.
- ``pause_mode="in_place"`` (SGLang's mode of that name): requests stay on the server through the
  pause, weights load with ``flush_cache`` false, and they go on with the new weights over their
  KV cache from the old ones: nothing is recomputed or sent again. SGLang 0.5.23 reports which
  tokens each version made (``meta_info.weight_versions``, spans over the output): each token gets
  its own; from a server that sends no spans, a response that spanned an update gets the version
  it started with for all its tokens (the oldest: the staleness bound stays strict). The
  behaviour logprobs are what was sampled from, so the decoupled objective's importance weights
  stay exact. SGLang's radix cache then holds prefixes computed under the old weights, which new
  requests would reuse: with ``flush_after_in_place`` (an SGLang fleet) a server that had
  requests across the update gets no new one until they have drained, then ``/flush_cache``.
- Prompt length, one rule on CPU and GPU: a sample's ``max_new_tokens`` is cut to what the
  server's context leaves (``budget_clamped`` on the response, ``rollout/budget_clamped_frac`` in
  the step metrics); a prompt that leaves no room is refused before it is sent
  (:class:`PromptTooLong`, an episode error). Both servers would answer a 400 otherwise.
- LoRA (issue 49): after :meth:`load_lora_adapter` every request names the current adapter
  (``lora_path``), each version loaded under its own name; :meth:`unload_unused_adapters` drops
  the older ones that no request in flight names. A request re-submitted after an interruption
  names the adapter current then, as a full-weight one continues under the new weights.
- Auth: every call carries the run's server key (``OOLONG_SERVER_KEY``, transport/server_auth.py).
- Errors of one request are errors of that episode, never retried: SGLang answers ``abort`` with
  no tokens for a request it cannot serve (input too long, ...) and HTTP 4xx for a malformed one.
  Both raise :class:`EpisodeError`; the executor counts the episode and the run goes on.
  Connection errors and 5xx are the servers' trouble: retried on another server, and after the
  retry window a :class:`RolloutServerError` fails the run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from training_core.api import (
    GenerationAborted,
    GenerationRequest,
    GenerationResponse,
    RequestRejected,
    RolloutServerError,
)
from training_core.transport.http import DEAD_AFTER_S, aretrying, refused
from training_core.transport.json_http import Connector, JsonHttpClient
from training_core.transport.server_auth import server_key
from training_core.transport.streaming import stream_generate
from training_core.transport.token_versions import parse_version, token_versions
from training_core.version import PolicyVersion

log = logging.getLogger(__name__)

MAX_ROUTES = 100_000  # sessions remembered for stickiness (the oldest forgotten first)


class PromptTooLong(RequestRejected):
    """The prompt leaves no room for one new token in the servers' context."""


@dataclass
class _Server:
    url: str
    in_flight: int = 0
    # In-place update done while it held requests: no new one until they drain, then a flush.
    flush_pending: bool = False
    down_until: float = 0.0
    failures: int = 0
    # Answered with weights older than the trainer's (a restarted server that has not loaded
    # the current ones): not routed to until the next weight update reaches it.
    behind: bool = False


@dataclass
class _Partial:
    """One sample being generated, possibly over several server calls."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str = ""
    interruptions: int = 0
    budget_clamped: bool = False

    @property
    def aborted(self) -> bool:
        return self.finish == "abort"

    def response(self, request: GenerationRequest) -> GenerationResponse:
        return GenerationResponse(
            input_ids=list(request.input_ids), output_ids=self.ids, output_logprobs=self.logprobs,
            output_versions=self.versions, finish_reason=self.finish,
            interruptions=self.interruptions, budget_clamped=self.budget_clamped)


class RolloutClient:
    def __init__(self, urls: list[str], *, timeout_s: float = 300.0, retries: int = 3,
                 cooldown_s: float = 2.0, retry_window_s: float = 120.0,
                 dead_after_s: float = DEAD_AFTER_S,
                 max_interruptions: int = 16, pause_mode: str = "abort",
                 version: PolicyVersion | None = None, connect: Connector | None = None,
                 api_key: str | None = None, flush_after_in_place: bool = False):
        if not urls:
            raise ValueError("RolloutClient needs at least one server URL")
        if pause_mode not in ("abort", "in_place"):
            raise ValueError(f"pause_mode: {pause_mode!r} is not 'abort' or 'in_place'")
        self.pause_mode = pause_mode
        self.servers = [_Server(u.rstrip("/")) for u in urls]
        self.timeout_s = timeout_s
        self.retries = retries
        self.cooldown_s = cooldown_s
        self.retry_window_s = retry_window_s
        self.dead_after_s = dead_after_s  # [issue 47] every server refusing: the run fails sooner
        self.max_interruptions = max_interruptions
        self._connect = connect  # tests connect the client to a scripted server here
        self.api_key = api_key if api_key is not None else server_key()
        self.flush_after_in_place = flush_after_in_place and pause_mode == "in_place"
        self._context_len: int | None = None  # the servers' max_req_input_len (least), read once
        self._bracket_routes: bool | None = None  # has /begin_weight_update (SGLang >= 0.5.2x)
        # The trainer's policy version (its one owner, training_core.version): admission and
        # routing read it; weight_sync.push_weights advances it.
        self.policy = version or PolicyVersion()
        self._json_clients: dict[int, JsonHttpClient] = {}  # one per event loop, see _request
        self._routes: dict[str, _Server] = {}  # route key -> its server (GenerationRequest)
        self.interruptions = 0
        # An abort is an interruption only if this client paused the servers while the request
        # was in flight: ``_pauses`` counts pauses, ``_paused`` is true until generation continues.
        # Plain attributes: written by the trainer's control loop, read by the executor's loop.
        self._pauses = 0
        self._paused = False
        # Interrupted samples wait for the resume on their own event loop: resume() wakes them.
        self._resume_events: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}
        # [issue 49] the adapter requests name (None: the base weights), the adapters loaded (in
        # order), and how many requests in flight name each (read by the control loop, written
        # by the executor's: hence the lock)
        self.lora_name: str | None = None
        self.loaded_adapters: list[str] = []
        self._adapter_uses: dict[str, int] = {}
        self._adapter_lock = threading.Lock()

    # ---- version ----------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.policy.current

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    # ---- HTTP plumbing ----------------------------------------------------------------------

    def _pick(self, route_key: str | None = None) -> _Server | None:
        now = time.monotonic()
        open_ = [s for s in self.servers if not s.flush_pending]
        if not open_:
            return None  # every server drains its in-place requests before a cache flush
        alive = [s for s in open_ if s.down_until <= now] or open_
        current = [s for s in alive if not s.behind] or alive
        if route_key is not None:  # a session sticks to its server (its prefix cache is there)
            server = self._routes.get(route_key)
            if server is None or server not in current:
                server = self._routes[route_key] = min(current, key=lambda s: s.in_flight)
                while len(self._routes) > MAX_ROUTES:
                    self._routes.pop(next(iter(self._routes)))
            return server
        return min(current, key=lambda s: s.in_flight)

    async def _request(self, server: _Server, method: str, path: str, payload: dict | None = None,
                       *, timeout_s: float | None = None) -> Any:
        """Every call to a rollout server, generation and control, GET and POST, goes here, over
        json_http's lean keep-alive client (httpx costs the trainer's thread GIL time, see
        json_http). One client per event loop: the executor's loop and short control loops."""
        status, body = await self._json_client().request(method, server.url + path, payload,
                                                          timeout_s=timeout_s)
        if status >= 400:
            raise RolloutServerError(
                f"{server.url}{path} -> {status}: {body[:300].decode(errors='replace')}",
                status=status)
        try:
            return json.loads(body) if body else {}
        except ValueError:
            raise RolloutServerError(f"{server.url}{path} -> {status}: not JSON: "
                                     f"{body[:300].decode(errors='replace')}", status=status) from None

    def _json_client(self) -> JsonHttpClient:
        """This event loop's connection pool (streams belong to the loop that opened them)."""
        key = id(asyncio.get_running_loop())
        client = self._json_clients.get(key)
        if client is None or client.closed:
            client = self._json_clients[key] = JsonHttpClient(
                timeout_s=self.timeout_s, connect=self._connect, bearer=self.api_key)
        return client

    async def _post(self, server: _Server, path: str, payload: dict | None = None) -> Any:
        return await self._request(server, "POST", path, payload or {})

    async def _get(self, server: _Server, path: str) -> Any:
        return await self._request(server, "GET", path, timeout_s=10.0)

    async def _generate_once(self, payload: dict, weight: int = 1,
                             route_key: str | None = None) -> dict | list:
        """POST /generate on the least-loaded healthy server; connection errors and 5xx move to
        another server and retry (the shared policy, training_core.transport.http) until ``retries``
        attempts and ``retry_window_s`` are both spent (a restarted server comes back within
        it). A 4xx is the request's fault and is never retried."""
        try:
            async for attempt in aretrying(self.retry_window_s, min_attempts=self.retries + 1,
                                           max_delay_s=2.0,
                                           retry_on=(httpx.TransportError, RolloutServerError),
                                           dead_after_s=self.dead_after_s):
                with attempt:
                    server = self._pick(route_key)
                    while server is None:
                        await asyncio.sleep(0.01)
                        server = self._pick(route_key)
                    return await self._generate_on(server, payload, weight)
        except (httpx.TransportError, RolloutServerError) as exc:
            if refused(exc):  # [issue 47] name the dead server(s), not a generic failure
                raise RolloutServerError(self._dead(exc)) from exc
            raise RolloutServerError(
                f"servers unreachable: generation failed after {self.retries + 1}+ attempts over "
                f"{self.retry_window_s:.0f}s: {exc}") from exc
        raise AssertionError("unreachable")  # pragma: no cover - tenacity re-raises

    async def _generate_on(self, server: _Server, payload: dict, weight: int) -> dict | list:
        server.in_flight += weight
        version = self.policy.current
        try:
            result = await self._post(server, "/generate", payload)
            items = result if isinstance(result, list) else [result]
            if any(parse_version(r.get("meta_info", {}).get("weight_version"), version) < version
                   for r in items if isinstance(r, dict)):
                if not server.behind:
                    log.warning("%s serves weights older than version %d: not routed to until "
                                "the next weight update", server.url, version)
                server.behind = True
            return result
        except RolloutServerError as exc:
            if exc.status is not None and 400 <= exc.status < 500:
                raise RequestRejected(str(exc)) from None
            self._mark_down(server, exc)
            raise
        except httpx.TransportError as exc:
            self._mark_down(server, exc)
            raise
        finally:
            server.in_flight -= weight
            if server.flush_pending and server.in_flight == 0:
                await self._flush(server)

    async def _flush(self, server: _Server) -> None:
        """SGLang's ``/flush_cache`` once the requests paused in place have drained (it flushes
        only an idle server, and answers in plain text); new requests go to it again after."""
        try:
            status, body = await self._json_client().request("POST", server.url + "/flush_cache", {})
            if status != 200:
                log.warning("%s/flush_cache -> %d: %s", server.url, status, body[:200])
        except (httpx.HTTPError, OSError) as exc:
            log.warning("%s/flush_cache failed: %s", server.url, exc)
        finally:
            server.flush_pending = False

    def _mark_down(self, server: _Server, exc: Exception) -> None:
        server.failures += 1
        server.down_until = time.monotonic() + self.cooldown_s
        log.warning("generate on %s failed (%d failures): %s", server.url, server.failures, exc)

    # ---- generation -------------------------------------------------------------------------

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        return (await self.agenerate_group(request, 1))[0]

    def agenerate_stream(self, request: GenerationRequest) -> AsyncIterator[GenerationResponse]:
        """Partial responses as the tokens are sampled; the last is complete
        (transport/streaming.py)."""
        return stream_generate(self, request)

    async def agenerate_group(self, request: GenerationRequest, n: int) -> list[GenerationResponse]:
        """``n`` samples of one prompt. The first round is one batched HTTP call (SGLang takes a
        list of ``input_ids``); samples interrupted by a weight update continue together once
        generation resumes."""
        request, clamped = await self._fit_context(request)
        budget = request.sampling.max_new_tokens
        states = [_Partial(budget_clamped=clamped) for _ in range(n)]
        pending = states
        while pending:
            await self._until_unpaused()
            await self._round(request, pending)
            for st in pending:
                if st.aborted and len(st.ids) >= budget:
                    st.finish = "length"  # interrupted exactly at the budget: nothing to resume
                elif st.aborted and st.interruptions > self.max_interruptions:
                    raise GenerationAborted(
                        f"a sample was interrupted {st.interruptions} times (limit "
                        f"{self.max_interruptions}): weight updates come faster than it generates")
            pending = [st for st in pending if st.aborted]
        return [st.response(request) for st in states]

    async def _fit_context(self, request: GenerationRequest) -> tuple[GenerationRequest, bool]:
        """The one prompt-length rule (module docstring): the budget cut to the room the
        context leaves, or the prompt refused when it leaves none."""
        if self._context_len is None:  # SGLang's scheduler bound: max_req_input_len
            infos = await self.server_infos(timeout_s=10.0)
            limits = [int(i["max_req_input_len"]) if isinstance(i.get("max_req_input_len"), int)
                      else int(i["context_length"]) - 6 for i in infos.values()
                      if i and isinstance(i.get("max_req_input_len", i.get("context_length")), int)]
            self._context_len = min(limits) if limits else 0  # 0: not reported, no rule
        limit, prompt = self._context_len, len(request.input_ids)
        if not limit:
            return request, False
        if prompt >= limit:
            raise PromptTooLong(f"a prompt of {prompt} tokens leaves no room in the servers' "
                                f"context (their max_req_input_len is {limit} tokens)")
        room = limit + 4 - prompt  # what SGLang's scheduler lets run: context - 2 - prompt
        if request.sampling.max_new_tokens <= room:
            return request, False
        return replace(request, sampling=replace(request.sampling, max_new_tokens=room)), True

    async def _until_unpaused(self) -> None:
        # Re-submitting while the servers are paused would only queue (SGLang) or abort again:
        # wait for continue_generation (resume() sets the event; the timeout is a safety net).
        if not self._paused:
            return
        loop = asyncio.get_running_loop()
        _, resumed = self._resume_events.setdefault(id(loop), (loop, asyncio.Event()))
        while self._paused:
            resumed.clear()
            if not self._paused:
                break
            try:
                await asyncio.wait_for(resumed.wait(), timeout=0.2)
            except TimeoutError:
                pass

    def _payload(self, request: GenerationRequest, states: list[_Partial]) -> dict:
        # SGLang's batch form: a list of input_ids and one sampling_params per sample, so
        # interrupted samples with different remaining budgets resume in one request.
        params = []
        for st in states:
            p = request.sampling.to_sglang()
            p["max_new_tokens"] = request.sampling.max_new_tokens - len(st.ids)
            params.append(p)
        ids = [request.input_ids + st.ids for st in states]
        if len(ids) == 1:
            return {"input_ids": ids[0], "sampling_params": params[0], "return_logprob": True}
        return {"input_ids": ids, "sampling_params": params, "return_logprob": True}

    @contextmanager
    def adapter_in_use(self) -> Iterator[str | None]:
        """The adapter a request names (the current one), counted as in use until it is back."""
        with self._adapter_lock:
            name = self.lora_name
            if name is not None:
                self._adapter_uses[name] = self._adapter_uses.get(name, 0) + 1
        try:
            yield name
        finally:
            if name is not None:
                with self._adapter_lock:
                    self._adapter_uses[name] -= 1

    async def _round(self, request: GenerationRequest, states: list[_Partial]) -> None:
        version_at_submit = self.policy.current
        pauses_at_submit = self._pauses
        with self.adapter_in_use() as adapter:
            payload = self._payload(request, states)
            if adapter is not None:
                payload["lora_path"] = adapter
            result = await self._generate_once(payload, weight=len(states),
                                               route_key=request.route_key)
        results = result if isinstance(result, list) else [result]
        if len(results) != len(states):
            raise RolloutServerError(f"asked for {len(states)} samples, got {len(results)}")
        paused_meanwhile = self._paused or self._pauses != pauses_at_submit
        for st, res in zip(states, results, strict=True):
            meta = res.get("meta_info", {})
            finish = meta.get("finish_reason") or {}
            ids = list(res.get("output_ids", []))
            lps = [float(x[0]) for x in meta.get("output_token_logprobs", [])]
            if len(lps) != len(ids):
                raise RolloutServerError("server returned logprobs that do not match output_ids")
            if finish.get("type") == "abort" and not paused_meanwhile:
                raise GenerationAborted(
                    f"server aborted the request with {len(ids)} tokens and no pause in progress: "
                    f"{finish.get('message') or 'no message'}")
            st.ids += ids
            st.logprobs += lps
            st.versions += token_versions(meta, len(ids), version_at_submit, paused_meanwhile)
            st.finish = finish.get("type", "stop")
            if st.finish == "abort":
                st.interruptions += 1
                self.interruptions += 1

    # ---- control ----------------------------------------------------------------------------

    async def _retrying(self, server: _Server, path: str, payload: dict | None = None, *,
                        get: bool = False) -> Any:
        """Control calls must reach every server: a restarting one is waited for (retry window)."""
        try:
            async for attempt in aretrying(self.retry_window_s, max_delay_s=2.0,
                                           retry_on=(httpx.TransportError,),
                                           dead_after_s=self.dead_after_s):
                with attempt:
                    if get:
                        return await self._get(server, path)
                    return await self._post(server, path, payload)
        except httpx.TransportError as exc:
            if refused(exc):
                raise RolloutServerError(self._dead(exc, [server])) from exc
            raise RolloutServerError(f"{server.url}{path} unreachable for "
                                     f"{self.retry_window_s:.0f}s: {exc}") from exc
        raise AssertionError("unreachable")  # pragma: no cover - tenacity re-raises

    def _dead(self, exc: BaseException, servers: list[_Server] | None = None) -> str:
        """[issue 47] The message when servers refuse every connection: which ones."""
        urls = ", ".join(s.url for s in servers or self.servers)
        return (f"rollout server {urls} is down: it refused every connection for "
                f"{self.dead_after_s:.0f}s (process dead? its log says why): {exc}")

    async def _all(self, path: str, payload: dict | None = None) -> list[dict]:
        return await asyncio.gather(*[self._retrying(s, path, payload) for s in self.servers])

    async def pause(self) -> None:
        # Marked before the call: requests aborted by it must find the pause already recorded.
        self._paused = True
        self._pauses += 1
        await self._all("/pause_generation", {"mode": self.pause_mode})

    async def resume(self) -> None:
        if self.flush_after_in_place:  # radix entries from the old weights: flush once drained
            for server in self.servers:
                server.flush_pending = True
        await self._all("/continue_generation")
        if self.flush_after_in_place:
            idle = [s for s in self.servers if s.in_flight == 0]
            await asyncio.gather(*[self._flush_now(s) for s in idle])
        self._paused = False
        for loop, resumed in list(self._resume_events.values()):
            if not loop.is_closed():
                loop.call_soon_threadsafe(resumed.set)

    @property
    def flush_cache(self) -> bool:
        """Whether a weight update flushes the servers' KV cache: not under requests paused in
        place (they rely on it, and SGLang's flush would fail)."""
        return self.pause_mode != "in_place"

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        payload: dict[str, Any] = {"model_path": path, "weight_version": str(version)}
        if not self.flush_cache:  # sent only when off: older SGLang releases lack the field
            payload["flush_cache"] = False
        results = await self._all("/update_weights_from_disk", payload)
        _check_all("update_weights_from_disk", self.servers, results)
        self._servers_current()

    # ---- LoRA adapters (SGLang's /load_lora_adapter, /unload_lora_adapter; issue 49) -------

    async def load_lora_adapter(self, name: str, path: str, version: int) -> None:
        """Load the adapter in ``path`` as ``name`` on every server and make it the one requests
        name; the servers' ``weight_version`` becomes ``version`` (SGLang's
        ``/update_weight_version``, without aborting: the pause decides what happens to
        requests in flight)."""
        await self._load_adapter("/load_lora_adapter", {"lora_name": name, "lora_path": path},
                                 version)

    async def load_lora_adapter_from_tensors(self, name: str, config: dict[str, Any],
                                             version: int) -> None:
        """As :meth:`load_lora_adapter`, for an adapter whose tensors the servers received over
        the weight update group (weight_sync distributed): ``config`` is its
        ``adapter_config.json``; the request carries no tensors (the embedded server's rule,
        rollout_server/server.py)."""
        await self._load_adapter("/load_lora_adapter_from_tensors", {
            "lora_name": name, "config_dict": config, "serialized_named_tensors": []}, version)

    async def _load_adapter(self, route: str, payload: dict[str, Any], version: int) -> None:
        name = payload["lora_name"]

        async def load(server: _Server) -> dict:
            try:
                return await self._retrying(server, route, payload)
            except RolloutServerError as exc:
                # A resumed run reloads its version under the same name: what the server holds
                # under it may be a discarded future's, so the checkpoint's replaces it.
                if exc.status != 400 or "already loaded" not in str(exc):
                    raise
            await self._retrying(server, "/unload_lora_adapter", {"lora_name": name})
            return await self._retrying(server, route, payload)

        loaded = await asyncio.gather(*[load(s) for s in self.servers])
        _check_all(route.lstrip("/"), self.servers, loaded)
        results = await self._all("/update_weight_version", {"new_version": str(version),
                                                              "abort_all_requests": False})
        _check_all("update_weight_version", self.servers, results)
        # The servers' own list (SGLang's loaded_adapters): a resumed run's client also learns
        # the adapters an earlier trainer loaded, and unloads them in turn.
        held = [n for r in results_of_load(loaded) for n in r]
        with self._adapter_lock:
            self.lora_name = name
            for n in [*held, name]:
                if n not in self.loaded_adapters:
                    self.loaded_adapters.append(n)
        self._servers_current()

    async def unload_unused_adapters(self) -> list[str]:
        """Unload every adapter but the current one that no request in flight names; returns
        their names (one still in use is left for a later call)."""
        with self._adapter_lock:
            idle = [n for n in self.loaded_adapters
                    if n != self.lora_name and self._adapter_uses.get(n, 0) == 0]
        for name in idle:
            results = await self._all("/unload_lora_adapter", {"lora_name": name})
            _check_all("unload_lora_adapter", self.servers, results)
            with self._adapter_lock:
                self.loaded_adapters.remove(name)
                self._adapter_uses.pop(name, None)
        return idle

    # ---- weights over the network (SGLang's distributed weight update) ----------------------

    async def tp_sizes(self) -> list[int]:
        """Each server's tensor-parallel size (its ranks in the weight update group)."""
        infos = await asyncio.gather(*[self._retrying(s, "/server_info", get=True)
                                       for s in self.servers])
        return [int(info.get("tp_size") or 1) for info in infos]

    async def init_weights_update_group(self, *, master_address: str, master_port: int,
                                        rank_offsets: list[int], world_size: int,
                                        group_name: str, backend: str) -> None:
        """Ask every server to join; returns once all have (the trainer's rank 0 joins
        concurrently, or this never returns)."""
        async def join(server: _Server, offset: int) -> dict:
            return await self._post(server, "/init_weights_update_group", {
                "master_address": master_address, "master_port": master_port,
                "rank_offset": offset, "world_size": world_size, "group_name": group_name,
                "backend": backend})

        results = await asyncio.gather(
            *[join(s, o) for s, o in zip(self.servers, rank_offsets, strict=True)])
        _check_all("init_weights_update_group", self.servers, results)

    async def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str,
                                              version: int | None, flush_cache: bool,
                                              load_format: str | None = None) -> None:
        """Announce one bucket; the servers then receive it by broadcast. ``version`` goes with
        the last bucket only, so a server reports the new version once it has all of it."""
        payload: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes,
                                   "group_name": group_name, "flush_cache": flush_cache}
        if version is not None:
            payload["weight_version"] = str(version)
        if load_format is not None:
            payload["load_format"] = load_format
        results = await asyncio.gather(
            *[self._post(s, "/update_weights_from_distributed", payload) for s in self.servers])
        _check_all("update_weights_from_distributed", self.servers, results)
        if version is not None:
            self._servers_current()

    async def destroy_weights_update_group(self, group_name: str) -> None:
        results = await asyncio.gather(
            *[self._post(s, "/destroy_weights_update_group", {"group_name": group_name})
              for s in self.servers], return_exceptions=True)
        for server, result in zip(self.servers, results, strict=True):
            if isinstance(result, BaseException):  # best effort: the group dies with the run
                log.warning("destroy_weights_update_group on %s: %s", server.url, result)

    async def _flush_now(self, server: _Server) -> None:
        if server.flush_pending and server.in_flight == 0:
            await self._flush(server)

    @asynccontextmanager
    async def weight_update_session(self) -> AsyncIterator[None]:
        """SGLang's ``/begin_weight_update`` ... ``/end_weight_update`` around a push, where the
        release has them: every server that began gets its end, also when the push fails in
        between (0.5.23 refuses a second begin while one is open, so a push that left one open
        would fail every later push). Failures to end are logged; the push's own error wins."""
        opened: list[_Server] = []
        failed: BaseException | None = None
        if self._bracket_routes is not False:
            results = await asyncio.gather(
                *[self._bracket(s, "/begin_weight_update") for s in self.servers],
                return_exceptions=True)
            opened = [s for s, r in zip(self.servers, results, strict=True) if r is True]
            if self._bracket_routes is None and all(r is False for r in results):
                self._bracket_routes = False  # a release without the bracket: never ask again
            elif opened:
                self._bracket_routes = True
            failed = next((r for r in results if isinstance(r, BaseException)), None)
        try:
            if failed is not None:
                raise failed
            yield
        finally:
            ends = await asyncio.gather(*[self._bracket(s, "/end_weight_update") for s in opened],
                                        return_exceptions=True)
            for server, end in zip(opened, ends, strict=True):
                if isinstance(end, BaseException):
                    log.warning("end_weight_update on %s failed: %s", server.url, end)

    async def _bracket(self, server: _Server, path: str) -> bool:
        """True once ``path`` succeeded, False on a 404 (a release without it). A session a dead
        trainer left open is closed, and begun again."""
        try:
            await self._retrying(server, path, {})
        except RolloutServerError as exc:
            if exc.status == 404:
                return False
            if path == "/begin_weight_update" and "already open" in str(exc):
                await self._retrying(server, "/end_weight_update", {})
                await self._retrying(server, path, {})
                return True
            raise
        return True

    def _servers_current(self) -> None:
        for server in self.servers:  # every server has the new weights now
            server.behind = False

    async def server_infos(self, urls: set[str] | None = None, *, path: str = "/server_info",
                           timeout_s: float = 2.0,
                           concurrency: int | None = None) -> dict[str, dict[str, Any] | None]:
        """``GET path`` of each server (of ``urls`` only, when given), concurrently (at most
        ``concurrency`` at once) and without retries, for monitoring: a server that does not
        answer within ``timeout_s`` (the whole exchange, so one trickling bytes cannot hold the
        round) or answers an error is None, never an exception; one that answers 200 without a
        JSON object is ``{}`` (alive, nothing to report). A round costs about the slowest answer,
        at most ``ceil(n / concurrency) * timeout_s``."""
        limit = asyncio.Semaphore(max(concurrency or len(self.servers), 1))

        async def one(server: _Server) -> dict[str, Any] | None:
            async with limit:
                try:
                    info = await asyncio.wait_for(
                        self._request(server, "GET", path, timeout_s=timeout_s), timeout_s)
                except RolloutServerError as exc:
                    return {} if exc.status is not None and exc.status < 400 else None
                except (httpx.HTTPError, TimeoutError, OSError):
                    return None
            return info if isinstance(info, dict) else {}

        chosen = [s for s in self.servers if urls is None or s.url in urls]
        infos = await asyncio.gather(*[one(s) for s in chosen])
        return {s.url: info for s, info in zip(chosen, infos, strict=True)}

    async def weight_versions(self) -> list[str]:
        """Each server's ``weight_version`` from ``GET /model_info`` (SGLang >= 0.5.2x; the older
        ``/get_weight_version`` is gone and ``/get_model_info`` is deprecated)."""
        infos = await asyncio.gather(*[self._retrying(s, "/model_info", get=True)
                                       for s in self.servers])
        return [str(info.get("weight_version")) for info in infos]

    async def check_versions(self, expected: int) -> None:
        """Fail clearly if a server does not serve the version the trainer believes it does (a
        server launched without ``--weight-version``, or one that missed a weight update)."""
        versions = await self.weight_versions()
        wrong = {s.url: v for s, v in zip(self.servers, versions, strict=True) if v != str(expected)}
        if wrong:
            raise RolloutServerError(f"rollout servers serve weight_version {wrong}, expected "
                                     f"{expected}; launch SGLang with --weight-version {expected}")

    async def aclose(self) -> None:
        lean = self._json_clients.pop(id(asyncio.get_running_loop()), None)
        if lean is not None:
            await lean.aclose()



def results_of_load(results: list[Any]) -> list[list[str]]:
    """The adapter names each server reports loaded after a ``/load_lora_adapter``."""
    return [list((r.get("loaded_adapters") or {}).keys()) if isinstance(r, dict) else []
            for r in results]


def _check_all(call: str, servers: list[_Server], results: list[Any]) -> None:
    for server, result in zip(servers, results, strict=True):
        if not (isinstance(result, dict) and result.get("success", False)):
            # SGLang's LoRA routes answer error_message, the others message
            message = (result.get("message") or result.get("error_message")
                       if isinstance(result, dict) else result)
            raise RolloutServerError(f"{call} failed on {server.url}: {message}")
