"""Streamed generation (``/generate`` with ``stream: true``, as SGLang streams it): partial
responses as the server samples the tokens, for the agent gateway's streamed answers.

``stream_generate(client, request)`` yields :class:`GenerationResponse` with everything so far
(ids, behaviour logprobs, versions); the last one is complete (its ``finish_reason`` set). It
follows the client's rules: the request's ``route_key`` picks the server (a session's turns go to
the one that holds their prefix cache), a server that fails before the first token is left for
another, a 4xx is :class:`RequestRejected`, and a sample aborted by a weight-update pause
(``pause_mode: abort``) is sent again with its partial output once generation continues, so the
stream goes on where it stopped. Closing the iterator closes the connection: the server aborts
the request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from training_core.api import (
    GenerationAborted,
    GenerationRequest,
    GenerationResponse,
    RequestRejected,
    RolloutServerError,
)
from training_core.transport.token_versions import token_versions


async def _events(http: httpx.AsyncClient, url: str, payload: dict[str, Any],
                  headers: dict[str, str]) -> AsyncIterator[dict[str, Any]]:
    async with http.stream("POST", url, json=payload, headers=headers) as resp:
        if resp.status_code >= 400:
            body = (await resp.aread())[:300].decode(errors="replace")
            if resp.status_code < 500:
                raise RequestRejected(f"{url} -> {resp.status_code}: {body}")
            raise RolloutServerError(f"{url} -> {resp.status_code}: {body}", status=resp.status_code)
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            item = json.loads(data)
            if "error" in item:
                raise RequestRejected(f"{url}: {item['error']}")
            yield item


async def stream_generate(client: Any, request: GenerationRequest
                          ) -> AsyncIterator[GenerationResponse]:
    """``client``: the :class:`~training_core.transport.rollout_client.RolloutClient` whose rules
    the stream follows (not imported here: that module imports this one)."""
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    interruptions = failures = 0

    request, clamped = await client._fit_context(request)  # the one prompt-length rule
    budget = request.sampling.max_new_tokens
    headers = {"Authorization": f"Bearer {client.api_key}"} if client.api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(client.timeout_s, connect=10.0)) as http:
        while True:
            await client._until_unpaused()
            version_at_submit = client.policy.current
            pauses_at_submit = client._pauses
            params = request.sampling.to_sglang()
            params["max_new_tokens"] = budget - len(ids)
            payload = {"input_ids": list(request.input_ids) + ids, "sampling_params": params,
                       "return_logprob": True, "stream": True}
            server = client._pick(request.route_key)
            while server is None:  # every server drains before its cache flush
                await asyncio.sleep(0.01)
                server = client._pick(request.route_key)
            server.in_flight += 1
            done = 0  # tokens of this round already yielded
            finish: dict[str, Any] = {}
            in_use = client.adapter_in_use()  # [issue 49] the current adapter, held this round
            adapter = in_use.__enter__()
            if adapter is not None:
                payload["lora_path"] = adapter
            try:
                async for item in _events(http, server.url + "/generate", payload, headers):
                    meta = item.get("meta_info", {})
                    out = list(item.get("output_ids", []))
                    lps = [float(x[0]) for x in meta.get("output_token_logprobs", [])]
                    if len(lps) != len(out):
                        raise RolloutServerError("server streamed logprobs that do not match "
                                                 "output_ids")
                    paused = client._paused or client._pauses != pauses_at_submit
                    ids += out[done:]
                    logprobs += lps[done:]
                    versions += token_versions(meta, len(out), version_at_submit, paused)[done:]
                    done = len(out)
                    finish = meta.get("finish_reason") or {}
                    yield GenerationResponse(list(request.input_ids), list(ids), list(logprobs),
                                             list(versions), finish.get("type", ""),
                                             interruptions, budget_clamped=clamped)
            except httpx.TransportError as exc:
                client._mark_down(server, exc)
                failures += 1
                if not ids and failures <= client.retries:  # nothing streamed: another server
                    continue
                raise RolloutServerError(f"{server.url} dropped a streamed request: {exc}") from exc
            finally:
                in_use.__exit__(None, None, None)
                server.in_flight -= 1
                if server.flush_pending and server.in_flight == 0:
                    await client._flush(server)
            kind = finish.get("type")
            paused = client._paused or client._pauses != pauses_at_submit
            if kind == "abort" and paused and len(ids) < budget:
                interruptions += 1
                client.interruptions += 1
                if interruptions > client.max_interruptions:
                    raise GenerationAborted(
                        f"a sample was interrupted {interruptions} times (limit "
                        f"{client.max_interruptions}): weight updates come faster than it "
                        "generates")
                continue
            if kind == "abort" and not paused:
                raise GenerationAborted(f"server aborted the streamed request with {len(ids)} "
                                        f"tokens: {finish.get('message') or 'no message'}")
            if kind == "abort":  # interrupted exactly at the budget
                yield GenerationResponse(list(request.input_ids), list(ids), list(logprobs),
                                         list(versions), "length", interruptions,
                                         budget_clamped=clamped)
            return
