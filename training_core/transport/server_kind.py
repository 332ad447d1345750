"""Which rollout server a URL is, checked against the run's ``rollout.backend``.

``rollout.backend`` is the one rule for which server a run has: it decides how servers start,
how a weight update pauses generation (in place on the embedded server, abort on SGLang) and
whether SGLang's radix cache is flushed. A run given ``server_urls`` must say which kind they are;
this makes a wrong word an error at the start instead of a run that trains on KV computed under
old weights: each server names itself in ``/server_info`` (``version``: ``oolong-embedded`` for
ours, the release for SGLang)."""

from __future__ import annotations

from typing import Any, Protocol

from training_core.api import RolloutServerError

EMBEDDED_VERSION = "oolong-embedded"  # what the embedded server reports as its version


class _Infos(Protocol):
    async def server_infos(self, urls: set[str] | None = None, *, path: str = ...,
                           timeout_s: float = ..., concurrency: int | None = ...
                           ) -> dict[str, dict[str, Any] | None]: ...


def kind_of(info: dict[str, Any]) -> str | None:
    """``embedded``, ``sglang``, or None for an answer that names no version."""
    version = info.get("version")
    if not isinstance(version, str):
        return None
    return "embedded" if version == EMBEDDED_VERSION else "sglang"


async def check_server_kind(client: _Infos, backend: str, *, timeout_s: float = 10.0) -> None:
    """Refuse servers of another kind than ``backend``, naming each and the fix. A server that
    does not answer is left to the client's own retries (it may still be starting)."""
    infos = await client.server_infos(timeout_s=timeout_s)
    wrong = {url: kind for url, info in infos.items()
             if info and (kind := kind_of(info)) is not None and kind != backend}
    if wrong:
        named = ", ".join(f"{url} is {_describe(kind, infos[url])}" for url, kind in sorted(wrong.items()))
        other = next(iter(wrong.values()))
        raise RolloutServerError(
            f"rollout.backend is {backend!r} but {named}: set rollout.backend: {other} (it "
            "decides how weight updates pause generation and whether SGLang's cache is flushed)")


def _describe(kind: str, info: dict[str, Any] | None) -> str:
    return f"SGLang {(info or {}).get('version')}" if kind == "sglang" else "an embedded server"
