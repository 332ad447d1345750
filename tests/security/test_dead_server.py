"""Issue 47, item 9: killing a run's only rollout server failed the run after 124 s of retries,
saying only "servers unreachable". A server that refuses every connection for
``transport.http.DEAD_AFTER_S`` (30 s) is dead: generation and control calls give up then, naming
it, whatever their retry window (a restart that comes back sooner is still waited for)."""

from __future__ import annotations

import asyncio

import pytest

from training_core.api import GenerationRequest, RolloutServerError, SamplingParams
from training_core.ports import free_port
from training_core.transport.http import DEAD_AFTER_S
from training_core.transport.rollout_client import RolloutClient


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens: connections are refused


def test_a_dead_only_server_fails_generation_naming_it():
    url = _dead_url()

    async def go():
        client = RolloutClient([url], dead_after_s=1.0)  # the retry window stays 120 s
        try:
            await client.agenerate(GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=2)))
        finally:
            await client.aclose()

    with pytest.raises(RolloutServerError, match=rf"rollout server {url} is down: it refused every "
                                                 r"connection for 1s"):
        asyncio.run(go())


def test_a_dead_server_fails_control_calls_naming_it():
    url = _dead_url()

    async def go():
        client = RolloutClient([url], dead_after_s=1.0)
        try:
            await client.pause()
        finally:
            await client.aclose()

    with pytest.raises(RolloutServerError, match=rf"rollout server {url} is down"):
        asyncio.run(go())


def test_the_run_gives_up_on_a_dead_server_within_30_s():
    assert DEAD_AFTER_S <= 30 and RolloutClient([_dead_url()]).dead_after_s == DEAD_AFTER_S
