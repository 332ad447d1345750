"""The embedded server's engine directly (no HTTP): a group's shared prompt is prefilled once,
and an idle engine gathers the requests that arrive together into one prefill."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from training_core.engines import generation_engine
from training_core.engines.deepspeed_trainer import sequence_logprobs
from training_core.engines.generation_engine import GenerationEngine, Seq
from training_core.models.loading import load_model


@pytest.fixture
def engine(tiny_model_dir):
    eng = GenerationEngine(str(tiny_model_dir), seed=3)
    batches: list[int] = []
    eng.model.register_forward_pre_hook(
        lambda _m, _a, kw: batches.append(kw["input_ids"].shape[0]), with_kwargs=True)
    eng.forward_batches = batches
    yield eng
    eng.shutdown()


def _run(engine: GenerationEngine, prompts: list[list[int]], *, temperature: float = 1.0,
         max_new_tokens: int = 8, gap_s: float = 0.0) -> list[dict]:
    async def main():
        loop = asyncio.get_running_loop()
        futures = []
        for i, prompt in enumerate(prompts):
            if gap_s and i:
                await asyncio.sleep(gap_s)
            fut = loop.create_future()
            engine.submit(Seq(f"r{i}", list(prompt), max_new_tokens, temperature, 1.0, 0, set(),
                              True, fut, loop))
            futures.append(fut)
        return await asyncio.gather(*futures)

    return asyncio.run(main())


def test_a_groups_prompt_is_prefilled_once_with_the_same_numbers(engine, tiny_model_dir):
    prompt = [7, 8, 9, 10, 11]
    outs = _run(engine, [prompt] * 16, max_new_tokens=6)
    assert engine.forward_batches[0] == 1, "one prefill row for 16 samples of one prompt"
    assert engine.forward_batches[1] == 16, "then every sample decodes"
    assert len({tuple(o["output_ids"]) for o in outs}) > 1, "sampled answers differ"
    model = load_model(tiny_model_dir).eval()
    for out in outs:
        ids = torch.tensor([prompt + out["output_ids"]])
        with torch.no_grad():
            ref = sequence_logprobs(model, ids, torch.ones_like(ids), 1.0)[0, len(prompt):]
        got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_greedy_samples_of_one_prompt_equal_a_lone_request(engine):
    prompt = [20, 21, 22]
    alone = _run(engine, [prompt], temperature=0.0)[0]["output_ids"]
    group = _run(engine, [prompt] * 8, temperature=0.0)
    assert all(o["output_ids"] == alone for o in group)


def test_an_idle_engine_gathers_requests_arriving_together(engine, monkeypatch):
    # Arrivals 20 ms apart are "together" once the quiet time is longer than that; the
    # default (3 ms) is tuned for one trainer's burst of requests over loopback.
    monkeypatch.setattr(generation_engine, "ADMIT_QUIET_S", 0.2)
    monkeypatch.setattr(generation_engine, "ADMIT_WINDOW_S", 5.0)
    prompts = [[5 + i] * (2 + i) for i in range(4)]
    started = time.perf_counter()
    _run(engine, prompts, gap_s=0.02, max_new_tokens=3)
    assert engine.forward_batches[0] == 4, engine.forward_batches
    assert time.perf_counter() - started < 3.0, "the engine starts once arrivals stop"


def test_the_gathering_window_is_bounded(engine, monkeypatch):
    monkeypatch.setattr(generation_engine, "ADMIT_QUIET_S", 0.2)
    monkeypatch.setattr(generation_engine, "ADMIT_WINDOW_S", 0.05)
    _run(engine, [[5, 6], [7, 8, 9]], gap_s=0.15, max_new_tokens=20)
    assert engine.forward_batches[0] == 1, "the first request started when the window closed"
