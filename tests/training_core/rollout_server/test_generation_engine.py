"""The embedded server's engine directly (no HTTP): a group's shared prompt is prefilled once,
and an idle engine gathers the requests that arrive together into one prefill."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from training_core.models.loading import load_model
from training_core.prefix_tree import sequence_logprobs
from training_core.rollout_server import generation_engine
from training_core.rollout_server.generation_engine import GenerationEngine, Seq
from training_core.rollout_server.packed_linear import PackedLinear


@pytest.fixture
def engine(tiny_model_dir):
    eng = GenerationEngine(str(tiny_model_dir), seed=3)
    batches: list[int] = []
    tokens: list[int] = []  # a prefill's distinct prefix nodes (rows hold prefix forests)

    def record(_m, args):
        ids = args[0]  # [rows, width] in a prefill, [rows] in a fused decode step
        batches.append(ids.shape[0])
        tokens.append(int((ids != 0).sum()))

    # the token embedding: every forward starts there, transformers' and fused_decode's alike
    eng.model.get_input_embeddings().register_forward_pre_hook(record)
    eng.forward_batches, eng.forward_tokens = batches, tokens
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
    if torch.backends.mkldnn.is_available():  # fp32 on packed weights, within 1e-4 all the same
        assert any(isinstance(m, PackedLinear) for m in engine.model.modules())
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
    assert engine.forward_tokens[0] == sum(len(p) for p in prompts), engine.forward_tokens
    assert time.perf_counter() - started < 3.0, "the engine starts once arrivals stop"


def test_the_gathering_window_is_bounded(engine, monkeypatch):
    monkeypatch.setattr(generation_engine, "ADMIT_QUIET_S", 0.2)
    monkeypatch.setattr(generation_engine, "ADMIT_WINDOW_S", 0.05)
    _run(engine, [[5, 6], [7, 8, 9]], gap_s=0.15, max_new_tokens=20)
    assert engine.forward_tokens[0] == 2, "the first request started when the window closed"


def test_requests_paused_in_place_go_on_with_new_weights_over_their_old_kv(engine, tiny_model_dir,
                                                                           tmp_path):
    """SGLang's in_place pause: an update that would flush the cache is refused; one with
    flush_cache false loads under the paused request, which then continues (not aborted, not
    recomputed): its next tokens come from the new weights over the KV of the old ones."""
    import threading

    from safetensors.torch import save_file
    from transformers import DynamicCache

    old = load_model(tiny_model_dir).eval()
    new = load_model(tiny_model_dir).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    (tmp_path / "v1").mkdir()
    save_file({k: v.contiguous() for k, v in new.state_dict().items() if k != "lm_head.weight"},
              str(tmp_path / "v1" / "model.safetensors"))

    prompt, budget, result = [7, 8, 9, 10], 40, {}
    thread = threading.Thread(target=lambda: result.update(
        _run(engine, [prompt], max_new_tokens=budget)[0]))
    thread.start()
    deadline = time.time() + 30
    while engine.tokens_generated < 6:
        assert time.time() < deadline, "the engine did not start generating"
        time.sleep(0.001)
    engine.pause("in_place")
    before = len(engine._active[0].output)  # sampled so far; the last is not in the KV yet
    refused = engine.update_weights(str(tmp_path / "v1"), "1")
    assert not refused["success"] and "flush_cache" in refused["message"]
    assert engine.update_weights(str(tmp_path / "v1"), "1", flush_cache=False)["success"]
    engine.resume()
    thread.join(30)
    out = result["output_ids"]
    assert len(out) == budget and result["meta_info"]["finish_reason"]["type"] == "length"
    assert 0 < before < budget
    # which version made which tokens, as SGLang 0.5.23 reports it: the last span's version
    assert result["meta_info"]["weight_versions"] == [
        {"version": "0", "start": 0, "end": before}, {"version": "1", "start": before, "end": budget}]
    assert result["meta_info"]["weight_version"] == "1"

    got = torch.tensor([x[0] for x in result["meta_info"]["output_token_logprobs"]])
    with torch.no_grad():
        ids = torch.tensor([prompt + out])
        ref_old = sequence_logprobs(old, ids, torch.ones_like(ids), 1.0)[0, len(prompt):]
        cache = DynamicCache()
        old(input_ids=torch.tensor([prompt + out[: before - 1]]), past_key_values=cache,
            use_cache=True)
        ref_new = []
        for j in range(before - 1, budget - 1):
            step = new(input_ids=torch.tensor([[out[j]]]), past_key_values=cache, use_cache=True,
                       position_ids=torch.tensor([[len(prompt) + j]]))
            ref_new.append(torch.log_softmax(step.logits[0, -1], -1)[out[j + 1]])
    torch.testing.assert_close(got[:before], ref_old[:before], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[before:], torch.stack(ref_new), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got[before:], ref_old[before:], atol=1e-2), "new weights were used"


def _sampling_row(temperature: float, top_k: int = -1, top_p: float = 1.0) -> Seq:
    return Seq("s", [1], 1, temperature, top_p, top_k, set(), False, None, None)


@pytest.mark.parametrize("rows", [
    [_sampling_row(1.0), _sampling_row(0.7, top_k=3), _sampling_row(1.3, top_p=0.6),
     _sampling_row(0.0)],
    [_sampling_row(1.0), _sampling_row(0.5), _sampling_row(1.7), _sampling_row(0.0)],
], ids=["truncated", "untruncated"])
def test_sampled_tokens_follow_the_truncated_tempered_distribution_and_report_its_logprobs(rows):
    """Each row draws from softmax(logits / T), restricted to its top-k and top-p set and
    renormalised; greedy rows take the argmax; the logprob reported is that of the tempered
    distribution before truncation (what the trainer recomputes)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, generator=g) * 2
    draws = 6000
    counts = torch.zeros(4, 12)
    for _ in range(draws // 100):
        batch = logits.repeat_interleave(100, 0)
        tokens, logprobs = generation_engine._sample(batch, [r for r in rows for _ in range(100)], g)
        tokens, logprobs = tokens.view(4, 100), logprobs.view(4, 100)
        for i in range(4):
            counts[i] += torch.bincount(tokens[i], minlength=12)
            scale = rows[i].temperature if rows[i].temperature > 0 else 1.0
            expected = torch.log_softmax(logits[i] / scale, -1)[tokens[i]]
            torch.testing.assert_close(logprobs[i], expected)

    def truncated(i: int) -> torch.Tensor:
        p = torch.softmax(logits[i] / rows[i].temperature, -1)
        order = p.argsort(descending=True)
        keep = torch.zeros(12, dtype=torch.bool)
        if rows[i].top_k > 0:
            keep[order[: rows[i].top_k]] = True
        else:  # top-p (1: everything): the smallest head of the sorted distribution reaching p
            before = p[order].cumsum(0) - p[order]
            keep[order[before <= rows[i].top_p]] = True
        return torch.where(keep, p, torch.zeros(())) / p[keep].sum()

    for i in range(3):
        expected = truncated(i)
        frequencies = counts[i] / draws
        assert not (frequencies[expected == 0] > 0).any(), f"row {i} drew an excluded token"
        torch.testing.assert_close(frequencies, expected, atol=0.025, rtol=0,
                                   msg=lambda m, i=i: f"row {i}: {m}")
    assert counts[3, logits[3].argmax()] == draws


@pytest.mark.parametrize("sampler", ["torch", "kernel"])
def test_inverse_cdf_draws_give_every_token_its_own_probability_over_a_large_vocabulary(sampler):
    """``draw`` (and cpu_kernels' sample, the same draw in one pass) is monotone in its uniform,
    so the set of uniforms drawing token i is an interval; its width is the probability the
    sampler gives i. Over a large vocabulary with one likely
    token and a long tail (a trained policy's shape), tail tokens and tokens at the two-level
    draw's block edges get their probability to 1e-5 relative. A CDF stored in float32 rounds
    near 1 to steps of 6e-8: tail tokens of ~1e-8 got twice their probability or none."""
    g = torch.Generator().manual_seed(0)
    vocab = 65_536
    logits = torch.randn(vocab, generator=g)
    logits[0] += 17.0
    probs = torch.softmax(logits, -1)  # float32, as the engine hands them over
    exact = probs.double() / probs.double().sum()
    chunk = generation_engine.DRAW_CHUNK
    tail = (exact < 1e-7).nonzero().view(-1)
    assert len(tail) > 10_000
    edges = torch.tensor([1, chunk - 1, chunk, chunk + 1, 7 * chunk, vocab - 1])
    pick = torch.cat([tail[torch.randperm(len(tail), generator=g)[:26]], edges])

    if sampler == "kernel":
        from training_core.rollout_server import cpu_kernels

        op = cpu_kernels.sample(torch.device("cpu"), torch.float32)
        if op is None:
            pytest.skip("no C++ toolchain to build cpu_kernels with")
        batch = logits.expand(len(pick), -1).contiguous()  # the kernel takes the logits
        ones = torch.ones(len(pick))

        def drawn(u: torch.Tensor) -> torch.Tensor:
            return op(batch, ones, u, chunk)[0]
    else:
        def drawn(u: torch.Tensor) -> torch.Tensor:
            return generation_engine.draw(probs.expand(len(u), -1), u)

    def first_u_drawing_at_least(token: torch.Tensor) -> torch.Tensor:
        lo = torch.zeros(len(token), dtype=torch.float64)
        hi = torch.ones(len(token), dtype=torch.float64)
        for _ in range(56):  # bisection down to 2^-56
            mid = (lo + hi) / 2
            reached = drawn(mid) >= token
            hi, lo = torch.where(reached, mid, hi), torch.where(reached, lo, mid)
        return hi

    width = first_u_drawing_at_least(pick + 1) - first_u_drawing_at_least(pick)
    relative = (width - exact[pick]).abs() / exact[pick]
    assert relative.max() < 1e-5, (pick[relative.argmax()], relative.max())


def test_a_draw_never_lands_on_a_token_of_probability_zero():
    """Zero-probability tokens (cut by top-k/top-p) are never drawn: not in a block of zeros,
    not at a block's edge, not with a uniform just below 1, not when the vocabulary is no
    multiple of the block."""
    chunk = generation_engine.DRAW_CHUNK
    vocab = 5 * chunk + 17
    probs = torch.zeros(1, vocab)
    allowed = torch.tensor([3, 2 * chunk - 1, 4 * chunk, vocab - 9])
    probs[0, allowed] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    u = torch.cat([torch.linspace(0, 1, 2001)[:-1], torch.tensor([1 - 1e-12, 0.1, 0.3, 0.6])])
    got = generation_engine.draw(probs.expand(len(u), -1), u.double())
    assert set(got.tolist()) == set(allowed.tolist())
    # Each allowed token over the share of [0, 1) its probability covers.
    counts = torch.bincount(got[:2000], minlength=vocab)[allowed]
    torch.testing.assert_close(counts.double() / 2000,
                               torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64),
                               atol=1e-3, rtol=0)


def test_a_bf16_engine_on_cpu_runs_packed_weights_and_repacks_them_on_an_update(tiny_model_dir,
                                                                               tmp_path):
    """bf16 on CPU: the engine's linear layers run on weights packed once for oneDNN
    (packed_linear.py), bitwise what F.linear gives. Its logprobs match a plain bf16 forward
    before and after a weight update from disk: the packed copies follow the new weights. On a
    CPU whose oneDNN cannot pack bf16 (AVX2 only) the engine keeps plain layers, and the same
    holds."""
    import torch.nn.functional as F
    from safetensors.torch import save_file

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    eng = GenerationEngine(str(tiny_model_dir), seed=1, dtype="bfloat16")
    try:
        packed = [m for m in eng.model.modules() if isinstance(m, PackedLinear)]
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            assert packed, "bf16 on CPU packs the linear layers"
            x = torch.randn(5, packed[0].in_features, dtype=torch.bfloat16)
            with torch.no_grad():
                assert torch.equal(packed[0](x), F.linear(x, packed[0].weight, packed[0].bias))
        else:
            assert not packed and eng._fused is None, "no bf16 packing here: plain layers"
        prompt = [7, 8, 9, 10]

        def assert_matches(model: torch.nn.Module) -> None:
            for out in _run(eng, [prompt] * 4, max_new_tokens=6):
                ids = torch.tensor([prompt + out["output_ids"]])
                with torch.no_grad():
                    ref = sequence_logprobs(model, ids, torch.ones_like(ids), 1.0)[0, len(prompt):]
                got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
                torch.testing.assert_close(got, ref.float(), atol=0.05, rtol=0.02)

        model = load_model(tiny_model_dir, "bfloat16").eval()
        assert_matches(model)
        g = torch.Generator().manual_seed(5)
        tied = model.config.tie_word_embeddings  # one tensor under two names: changed once
        new = {k: (v.float() * 1.5 + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype)
               for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        (tmp_path / "new").mkdir()
        save_file(new, str(tmp_path / "new" / "model.safetensors"))
        assert eng.update_weights(str(tmp_path / "new"), "v1")["success"]
        model.load_state_dict(new, strict=not tied)
        assert_matches(model)
    finally:
        eng.shutdown()
