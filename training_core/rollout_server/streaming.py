"""``/generate`` with ``stream: true``, as SGLang streams it: server-sent events, one per decode
step, each ``data: {"text", "output_ids", "meta_info"}`` with everything so far (SGLang's default,
non-incremental output: ids and ``output_token_logprobs`` cumulative, ``finish_reason`` null until
the last), then ``data: [DONE]``. A client that goes away aborts its request in the engine
(SGLang does the same), so a cancelled agent turn stops generating at once.

One input per streamed request (a list of inputs is a 400 naming ``stream``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from training_core.rollout_server.engine_process import EngineProcess


async def events(engine: EngineProcess, tokenizer: Any, rid: str, input_ids: list[int],
                 sampling: dict[str, Any], *, return_logprob: bool = True) -> AsyncIterator[bytes]:
    """``return_logprob`` false: no ``output_token_logprobs`` in any event, as SGLang."""
    ids: list[int] = []
    logprobs: list[float] = []
    finished = False
    stream = engine.generate_stream(rid, input_ids, sampling)
    try:
        async for item in stream:
            if isinstance(item, dict):  # the response: as the non-streamed one
                finished = True
                if not return_logprob:
                    item["meta_info"].pop("output_token_logprobs", None)
                yield b"data: " + json.dumps(item).encode() + b"\n\n"
                break
            new_ids, new_lps = item
            ids += new_ids
            logprobs += new_lps
            meta = {"id": rid, "finish_reason": None, "prompt_tokens": len(input_ids),
                    "completion_tokens": len(ids)}
            if return_logprob:
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in
                                                 zip(logprobs, ids, strict=True)]
            yield b"data: " + json.dumps({
                "text": tokenizer.decode(ids, skip_special_tokens=True), "output_ids": ids,
                "meta_info": meta}).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        await stream.aclose()
        if not finished:  # the client went away: stop generating for it
            asyncio.ensure_future(engine.call("abort_request", rid=rid))
