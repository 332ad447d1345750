"""Async client for SGLang's native HTTP API over N rollout servers.

- Least-in-flight routing; a server that fails a request is skipped for a cool-down.
- Timeouts and retries on connection errors and 5xx (another server is tried).
- Interruptible generation: a request that comes back with finish reason ``abort`` (the trainer
  paused the servers to push weights) is re-submitted with its partial output appended to the
  prompt, so one sequence can span several policy versions. Every output token keeps the
  version that produced it and its behaviour logprob.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from training_core.api import GenerationRequest, GenerationResponse

log = logging.getLogger(__name__)


class RolloutServerError(RuntimeError):
    pass


@dataclass
class _Server:
    url: str
    in_flight: int = 0
    down_until: float = 0.0
    failures: int = 0


@dataclass
class _Partial:
    """One sample being generated, possibly over several server calls."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str = ""
    interruptions: int = 0

    @property
    def aborted(self) -> bool:
        return self.finish == "abort"

    def response(self, request: GenerationRequest, latency: float) -> GenerationResponse:
        finish = "length" if self.finish == "abort" else self.finish  # aborted at the budget
        return GenerationResponse(
            input_ids=list(request.input_ids), output_ids=self.ids, output_logprobs=self.logprobs,
            output_versions=self.versions, finish_reason=finish,
            interruptions=self.interruptions, latency_s=latency)


class RolloutClient:
    def __init__(self, urls: list[str], *, timeout_s: float = 300.0, retries: int = 3,
                 cooldown_s: float = 2.0, retry_window_s: float = 120.0):
        if not urls:
            raise ValueError("RolloutClient needs at least one server URL")
        self.servers = [_Server(u.rstrip("/")) for u in urls]
        self.timeout_s = timeout_s
        self.retries = retries
        self.cooldown_s = cooldown_s
        self.retry_window_s = retry_window_s
        self._version = 0
        self._clients: dict[int, httpx.AsyncClient] = {}
        self.interruptions = 0

    # ---- version ----------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = version

    # ---- HTTP plumbing ----------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        # One AsyncClient per event loop: the executor's loop and short-lived control loops.
        loop = asyncio.get_running_loop()
        key = id(loop)
        client = self._clients.get(key)
        if client is None or client.is_closed:
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
            client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=10.0),
                                       limits=limits)
            self._clients[key] = client
        return client

    def _pick(self) -> _Server:
        now = time.monotonic()
        alive = [s for s in self.servers if s.down_until <= now] or self.servers
        return min(alive, key=lambda s: s.in_flight)

    async def _post(self, server: _Server, path: str, payload: dict | None = None) -> Any:
        resp = await self._client().post(server.url + path, json=payload or {})
        if resp.status_code >= 400:
            raise RolloutServerError(f"{server.url}{path} -> {resp.status_code}: {resp.text[:300]}")
        return resp.json() if resp.content else {}

    async def _generate_once(self, payload: dict, weight: int = 1) -> dict | list:
        """POST /generate, retrying connection errors and 5xx on the least-loaded healthy server
        until ``retry_window_s`` has passed (a restarted server comes back within it)."""
        deadline = time.monotonic() + self.retry_window_s
        attempt = 0
        while True:
            server = self._pick()
            server.in_flight += weight
            try:
                return await self._post(server, "/generate", payload)
            except (httpx.TransportError, RolloutServerError) as exc:
                server.failures += 1
                server.down_until = time.monotonic() + self.cooldown_s
                attempt += 1
                if attempt > self.retries and time.monotonic() > deadline:
                    raise RolloutServerError(
                        f"generation failed after {attempt} attempts over "
                        f"{self.retry_window_s:.0f}s: {exc}") from exc
                log.warning("generate on %s failed (attempt %d): %s", server.url, attempt, exc)
                await asyncio.sleep(min(0.2 * 2**attempt, 2.0))
            finally:
                server.in_flight -= weight

    # ---- generation -------------------------------------------------------------------------

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        return (await self.agenerate_group(request, 1))[0]

    async def agenerate_group(self, request: GenerationRequest, n: int) -> list[GenerationResponse]:
        """``n`` samples of one prompt. The first round is one batched HTTP call (SGLang takes a
        list of ``input_ids``); samples interrupted by a weight update continue one by one."""
        start = time.perf_counter()
        states = [_Partial() for _ in range(n)]
        await self._round(request, states)
        while True:  # samples interrupted by a weight update resume together
            aborted = [st for st in states if st.aborted]
            if not aborted:
                break
            await self._round(request, aborted)
        return [st.response(request, time.perf_counter() - start) for st in states]

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

    async def _round(self, request: GenerationRequest, states: list[_Partial]) -> None:
        version_at_submit = self._version
        result = await self._generate_once(self._payload(request, states), weight=len(states))
        results = result if isinstance(result, list) else [result]
        if len(results) != len(states):
            raise RolloutServerError(f"asked for {len(states)} samples, got {len(results)}")
        for st, res in zip(states, results, strict=True):
            meta = res.get("meta_info", {})
            ids = list(res.get("output_ids", []))
            lps = [float(x[0]) for x in meta.get("output_token_logprobs", [])]
            if len(lps) != len(ids):
                raise RolloutServerError("server returned logprobs that do not match output_ids")
            version = _parse_version(meta.get("weight_version"), version_at_submit)
            st.ids += ids
            st.logprobs += lps
            st.versions += [version] * len(ids)
            st.finish = (meta.get("finish_reason") or {}).get("type", "stop")
            if st.finish == "abort":
                st.interruptions += 1
                self.interruptions += 1

    # ---- control ----------------------------------------------------------------------------

    async def _post_retrying(self, server: _Server, path: str, payload: dict | None) -> Any:
        """Control calls must reach every server: a restarting one is waited for (retry window)."""
        deadline = time.monotonic() + self.retry_window_s
        delay = 0.2
        while True:
            try:
                return await self._post(server, path, payload)
            except httpx.TransportError as exc:
                if time.monotonic() > deadline:
                    raise RolloutServerError(f"{server.url}{path} unreachable for "
                                             f"{self.retry_window_s:.0f}s: {exc}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _all(self, path: str, payload: dict | None = None) -> list[dict]:
        return await asyncio.gather(*[self._post_retrying(s, path, payload) for s in self.servers])

    async def pause(self) -> None:
        await self._all("/pause_generation", {"mode": "abort"})

    async def resume(self) -> None:
        await self._all("/continue_generation")

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        results = await self._all("/update_weights_from_disk",
                                  {"model_path": path, "weight_version": str(version)})
        bad = [r for r in results if not r.get("success", False)]
        if bad:
            raise RolloutServerError(f"weight update failed: {bad[0].get('message')}")
        self._version = version

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        for server in self.servers:
            while True:
                try:
                    resp = await self._client().get(server.url + "/health", timeout=5.0)
                    if resp.status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RolloutServerError(f"{server.url} not healthy after {timeout_s:.0f}s")
                await asyncio.sleep(0.25)

    async def server_info(self) -> list[dict]:
        return [(await self._client().get(s.url + "/get_server_info")).json() for s in self.servers]

    async def aclose(self) -> None:
        client = self._clients.pop(id(asyncio.get_running_loop()), None)
        if client is not None:
            await client.aclose()


def _parse_version(value: object, fallback: int) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return fallback
