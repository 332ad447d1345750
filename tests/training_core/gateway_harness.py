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

    @property
    def version(self) -> int:
        return self.client.version

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        resp = await self.client.agenerate(request)
        self.calls.append((list(request.input_ids), resp))
        return resp


class GatewayThread:
    def __init__(self, server_url: str, tokenizer: Any, sampling: SamplingParams, **kw: Any):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.tokenizer = tokenizer

        async def make():
            self.engine = RecordingEngine(RolloutClient([server_url]))
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
            await self.engine.client.aclose()

        self.call(shut())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
