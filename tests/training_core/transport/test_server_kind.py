"""rollout.backend against what the servers say they are: a mismatch is refused at the start."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.training_core.scripted_http import ScriptedServer
from training_core.api import RolloutServerError
from training_core.transport.rollout_client import RolloutClient
from training_core.transport.server_kind import check_server_kind

pytestmark = pytest.mark.unit  # no process, network or database (conftest)

VERSIONS = {"a": "oolong-embedded", "b": "0.5.23"}


def _client(hosts: list[str]) -> RolloutClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/server_info":
            return httpx.Response(404)
        return httpx.Response(200, json={"version": VERSIONS[request.url.host], "tp_size": 1})

    return RolloutClient([f"http://{h}:1" for h in hosts], connect=ScriptedServer(handler))


def _check(hosts: list[str], backend: str) -> None:
    async def go() -> None:
        client = _client(hosts)
        try:
            await check_server_kind(client, backend)
        finally:
            await client.aclose()

    asyncio.run(go())


def test_servers_of_the_declared_kind_pass():
    _check(["a"], "embedded")
    _check(["b"], "sglang")


def test_a_server_of_another_kind_is_refused_naming_it_and_the_fix():
    """The README once said server_urls means SGLang while the code keyed on rollout.backend: a
    user with SGLang URLs and the default backend got the embedded pause without a cache flush."""
    with pytest.raises(RolloutServerError, match=r"rollout.backend is 'embedded' but "
                                                 r"http://b:1 is SGLang 0.5.23: set "
                                                 r"rollout.backend: sglang"):
        _check(["a", "b"], "embedded")
    with pytest.raises(RolloutServerError, match="http://a:1 is an embedded server"):
        _check(["a"], "sglang")
