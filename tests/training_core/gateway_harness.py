"""A gateway on its own event loop thread, in front of a real embedded server, for tests that
call it with the real ``openai`` package from the test thread."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from training_core.api import GenerationRequest, GenerationResponse, SamplingParams
from training_core.gateway.chat import ChatRenderer
from training_core.gateway.server import Gateway
from training_core.transport.rollout_client import RolloutClient


class RecordingEngine:
    """The real client, keeping each request and response (what the server produced)."""

    def __init__(self, client: RolloutClient):
        self.client = client
        self.calls: list[tuple[list[int], GenerationResponse]] = []
        self.requests: list[GenerationRequest] = []
        self.streamed = 0  # partial responses the client streamed

    @property
    def version(self) -> int:
        return self.client.version

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        resp = await self.client.agenerate(request)
        self.calls.append((list(request.input_ids), resp))
        self.requests.append(request)
        return resp

    def __getattr__(self, name: str) -> Any:
        if name == "agenerate_stream" and hasattr(self.client, "agenerate_stream"):
            return self._stream
        raise AttributeError(name)

    async def _stream(self, request: GenerationRequest):
        """The client's stream, recording the last response it gave (what the gateway kept)."""
        last = None
        updates = self.client.agenerate_stream(request)
        try:
            async for last in updates:
                self.streamed += 1
                yield last
        finally:
            await updates.aclose()
            if last is not None:
                self.calls.append((list(request.input_ids), last))
                self.requests.append(request)


class GatewayThread:
    """``server_url``: a real rollout server; or ``engine=``: an engine of the test's (a scripted
    model of a family that cannot run here)."""

    def __init__(self, server_url: str | None, tokenizer: Any, sampling: SamplingParams,
                 engine: Any = None, **kw: Any):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.tokenizer = tokenizer

        async def make():
            self.engine = engine or RecordingEngine(RolloutClient([server_url]))
            self.gateway = Gateway(self.engine, ChatRenderer(tokenizer, kw.pop("tool_format", "auto")),
                                   sampling, **kw)
            return await self.gateway.start_tcp()

        self.url = self.call(make())

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(300)

    def open(self, **kw: Any):
        async def opened():
            return self.gateway.open_session(**kw)

        return self.call(opened())

    def close(self) -> None:
        async def shut():
            await self.gateway.aclose()
            if hasattr(self.engine, "client"):
                await self.engine.client.aclose()

        self.call(shut())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
