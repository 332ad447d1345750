"""The engine's fused decode step (fused_decode.py) against transformers' forward: the same
greedy tokens and logprobs in fp32, on the tiny model and on SmolLM2, before and after a weight
update; in bf16 no further from the fp32 model than transformers' own bf16 decode; and the
models it does not describe decode through transformers."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from training_core.models.loading import load_model
from training_core.prefix_tree import sequence_logprobs
from training_core.rollout_server.generation_engine import GenerationEngine, Seq

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="the fused kernels are oneDNN's")


@pytest.fixture(scope="module")
def smollm2_dir():
    from training_core.models.smollm2 import ensure_smollm2

    return ensure_smollm2()


def _generate(eng: GenerationEngine, prompts: list[list[int]], *, temperature: float,
              max_new_tokens: int = 16) -> list[dict]:
    async def main():
        loop = asyncio.get_running_loop()
        futures = []
        for i, prompt in enumerate(prompts):
            fut = loop.create_future()
            eng.submit(Seq(f"r{i}", list(prompt), max_new_tokens, temperature, 1.0, 0, set(), True,
                           fut, loop))
            futures.append(fut)
        return await asyncio.gather(*futures)

    return asyncio.run(main())


def _logprobs(out: dict) -> torch.Tensor:
    return torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])


def _both(model_dir, prompts, dtype="float32", **kw) -> tuple[list[dict], list[dict]]:
    """The same greedy requests through transformers' decode and the fused one."""
    outs = []
    for fused in (False, True):
        eng = GenerationEngine(str(model_dir), seed=1, dtype=dtype, fused_decode=fused)
        try:
            assert (eng._fused is not None) == fused
            outs.append(_generate(eng, prompts, temperature=0.0, **kw))
        finally:
            eng.shutdown()
    return outs[0], outs[1]


PROMPTS = [[1, 7 + i, 8, 9, 10 + 2 * i] for i in range(6)]


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_fp32_decodes_the_same_tokens_with_the_same_logprobs(model, tiny_model_dir, request):
    model_dir = tiny_model_dir if model == "tiny" else request.getfixturevalue("smollm2_dir")
    plain, fused = _both(model_dir, PROMPTS)
    for a, b in zip(plain, fused, strict=True):
        assert a["output_ids"] == b["output_ids"]
        torch.testing.assert_close(_logprobs(b), _logprobs(a), atol=2e-4, rtol=0)


def test_a_weight_update_reaches_the_fused_weights(tiny_model_dir, tmp_path):
    """After an update from disk the fused q/k/v copy follows the new weights: its logprobs are
    the new model's (transformers' forward on it), not the old one's."""
    from safetensors.torch import save_file

    eng = GenerationEngine(str(tiny_model_dir), seed=1, fused_decode=True)
    try:
        assert eng._fused is not None
        model = load_model(tiny_model_dir).eval()
        g = torch.Generator().manual_seed(3)
        tied = model.config.tie_word_embeddings
        new = {k: v * 1.3 + 0.05 * torch.randn(v.shape, generator=g)
               for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        (tmp_path / "new").mkdir()
        save_file(new, str(tmp_path / "new" / "model.safetensors"))
        assert eng.update_weights(str(tmp_path / "new"), "v1")["success"]
        model.load_state_dict(new, strict=not tied)
        for prompt, out in zip(PROMPTS, _generate(eng, PROMPTS, temperature=1.0), strict=True):
            ids = torch.tensor([prompt + out["output_ids"]])
            with torch.no_grad():
                ref = sequence_logprobs(model, ids, torch.ones_like(ids), 1.0)[0, len(prompt):]
            torch.testing.assert_close(_logprobs(out), ref.float(), atol=2e-4, rtol=0)
    finally:
        eng.shutdown()


def test_bf16_is_no_further_from_the_model_than_transformers_bf16_decode(smollm2_dir):
    """bf16 rounds differently when a product or an add is fused into a matmul (once, not
    twice), so greedy paths may part at near ties; what counts for RL is the distance of the
    sampled tokens' logprobs from the model's: measured against SmolLM2 in fp32 on each
    engine's own samples, the fused decode must not be further than transformers' (measured
    here: 0.043 against 0.047 nats mean over 512 tokens)."""
    if _packed_dtype() != "bfloat16":  # both engines would be transformers' forward
        pytest.skip("this CPU's oneDNN packs no bf16 (AVX2 alone): a bf16 model does not decode "
                    "on the fused layers here")
    reference = load_model(smollm2_dir, "float32").eval()
    prompts = [[1, 504 + i, 2, 308, 17 + i] for i in range(16)]
    distance = {}
    for fused in (False, True):
        eng = GenerationEngine(str(smollm2_dir), seed=7, dtype="bfloat16", fused_decode=fused)
        try:
            assert (eng._fused is not None) == fused, "the fused side must decode on the fused layers"
            outs = _generate(eng, prompts, temperature=1.0, max_new_tokens=32)
        finally:
            eng.shutdown()
        gaps = []
        for prompt, out in zip(prompts, outs, strict=True):
            ids = torch.tensor([prompt + out["output_ids"]])
            with torch.no_grad():
                ref = sequence_logprobs(reference, ids, torch.ones_like(ids), 1.0)[0, len(prompt):]
            gaps.append((_logprobs(out) - ref.float()).abs())
        distance[fused] = torch.cat(gaps).mean().item()
    assert distance[True] <= distance[False] * 1.1, distance
    assert distance[True] < 0.1, distance  # bf16's own rounding, not a wrong computation


def test_models_it_does_not_describe_decode_through_transformers(tiny_model_dir):
    from training_core.rollout_server import fused_decode

    model = load_model(tiny_model_dir).eval()
    assert not fused_decode.supports(model), "linear layers not packed: nothing to fuse with"
    eng = GenerationEngine(str(tiny_model_dir), seed=1)
    try:
        assert fused_decode.supports(eng.model)
        for change in ({"hidden_act": "gelu"}, {"attention_bias": True},
                       {"sliding_window": 16}):
            saved = {k: getattr(eng.model.config, k, None) for k in change}
            try:
                for k, v in change.items():
                    setattr(eng.model.config, k, v)
                assert not fused_decode.supports(eng.model), change
            finally:
                for k, v in saved.items():
                    setattr(eng.model.config, k, v)
    finally:
        eng.shutdown()


def _packed_dtype() -> str:
    """The projection kernels' tests run in bf16 where oneDNN packs it on this CPU (its reference
    path), else in fp32 (an AVX2 CPU: oneDNN's bf16 needs AVX-512 or AVX-NE-CONVERT)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(32, 32, dtype=torch.bfloat16), 16)
    except RuntimeError:
        return "float32"
    return "bfloat16"


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_kernel_projections_decode_as_well_as_onednns_and_follow_a_weight_update(model, tiny_model_dir,
                                                                                 request, monkeypatch):
    """Where cpu_kernels has a projection kernel for this CPU (AMX's for 17+ rows, else AVX-512's,
    else AVX2's, here at every batch whether or not it outruns oneDNN's on this CPU:
    OOLONG_AVX512_LINEAR=1, OOLONG_AVX2_LINEAR=1), a bf16 batch decodes on it, and its step's
    logits are as close to the same weights computed in fp32 as oneDNN's bf16 step is (their sums
    are taken in other orders, and SiLU's exp is the kernel's own), before and after new weights,
    which its copies follow. Where oneDNN cannot pack bf16 (an AVX2 CPU) the batch is fp32, and
    its logits are oneDNN's fp32 ones up to the order of the sums."""
    from training_core.rollout_server import cpu_kernels, fused_decode
    from training_core.rollout_server.packed_linear import pack_linears, repack
    from training_core.rollout_server.prefill import forest_prefill
    from training_core.rollout_server.slot_cache import ATTENTION, SlotCache

    monkeypatch.setenv(cpu_kernels.AVX512_LINEAR_ENV, "1")
    monkeypatch.setenv(cpu_kernels.AVX2_LINEAR_ENV, "1")
    low = _packed_dtype()
    kernel = cpu_kernels.projections(torch.device("cpu"), getattr(torch, low))
    if kernel is None:
        pytest.skip("no projection kernel for this CPU (AMX-BF16, AVX-512 with BF16 or AVX2)")
    model_dir = tiny_model_dir if model == "tiny" else request.getfixturevalue("smollm2_dir")
    models = {}
    for dtype in dict.fromkeys((low, "float32")):  # fp32: the reference, over the same (bf16) values
        lm = load_model(model_dir, low).eval()
        if dtype == "float32":
            lm = lm.float()
        pack_linears(lm)
        lm.config._attn_implementation = ATTENTION
        models[dtype] = (lm, fused_decode.FusedDecoder(lm))
    lm, decoder = models[low]
    assert decoder._proj is not None and decoder._proj.name == kernel.name
    decoder._layers_op = None  # the layers' loop in Python, whose calls the test counts
    vocab = lm.config.vocab_size
    prompts = [[1, (7 + i) % vocab, 8, 9, (10 + 3 * i) % vocab][: 3 + i % 3] for i in range(20)]
    calls = []

    def step(dtype: str, on_kernel: bool = False) -> torch.Tensor:
        calls.clear()
        model, dec = models[dtype]
        if dtype == low:
            dec._proj = dataclasses.replace(
                kernel, min_rows=kernel.min_rows if on_kernel else 1 << 30,
                linear=lambda *args: calls.append(args[3]) or kernel.linear(*args))
        with torch.no_grad():
            layers_kv, mask, last = forest_prefill(model, prompts, torch.device("cpu"))
            slots = SlotCache(len(layers_kv), layers_kv[0][0].shape[1], layers_kv[0][0].shape[3],
                              layers_kv[0][0].dtype, torch.device("cpu"),
                              keys_blocked=dec.uses_kernels)
            slots.join(layers_kv, mask, torch.arange(len(prompts)))
            return dec(last.argmax(-1), mask.sum(-1), slots.decode_mask(), slots).float()

    def as_close_as_onednn(on_kernel: torch.Tensor, onednn: torch.Tensor, ref: torch.Tensor) -> None:
        if low == "float32":  # oneDNN's step is the reference: the same sums in another order
            torch.testing.assert_close(on_kernel, onednn, atol=2e-3, rtol=1e-3)
            assert (on_kernel.argmax(-1) == onednn.argmax(-1)).float().mean() >= 0.95
            return
        assert (on_kernel - ref).abs().mean() <= 1.25 * (onednn - ref).abs().mean()
        greedy = ref.argmax(-1)
        assert (on_kernel.argmax(-1) == greedy).float().mean() >= (onednn.argmax(-1) == greedy).float().mean() - 0.1

    before = step(low, on_kernel=True)
    layers = lm.config.num_hidden_layers  # qkv, o, gate and up, down per layer, and lm_head
    assert sorted(set(calls)) == ["add", "none", "silu_mul"] and len(calls) == 4 * layers + (
        decoder._proj_head is not None)
    onednn = step(low)
    assert calls == []
    as_close_as_onednn(before, onednn, step("float32"))
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for p in lm.model.layers.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g).to(p.dtype))
        ref = models["float32"][0]
        if ref is not lm:
            ref.load_state_dict({k: v.float() for k, v in lm.state_dict().items()})
    for model_, dec in models.values():
        repack(model_)
        dec.refresh()
    after = step(low, on_kernel=True)
    as_close_as_onednn(after, step(low), step("float32"))
    assert (after - before).abs().mean() > 0.05 * after.abs().mean(), "the kernel's copies must follow"


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
@pytest.mark.parametrize("precision", ["packed", "float32"])
def test_the_layers_in_one_call_are_the_python_loop_bit_for_bit(model, precision, tiny_model_dir,
                                                                   request, monkeypatch):
    """Where the kernels make the whole step, the decoder runs its layers in one call
    (cpu_kernels.decode_layers), in bf16 (where oneDNN packs it) and in fp32: the same operators in the same order as its loop in Python, so
    the same logits and the same keys and values in the cache, bit for bit, over three steps (the
    cache's column moving), before and after new weights (the call's lists follow them)."""
    from training_core.rollout_server import cpu_kernels, fused_decode
    from training_core.rollout_server.packed_linear import pack_linears, repack
    from training_core.rollout_server.prefill import forest_prefill
    from training_core.rollout_server.slot_cache import ATTENTION, SlotCache

    monkeypatch.setenv(cpu_kernels.AVX512_LINEAR_ENV, "1")
    monkeypatch.setenv(cpu_kernels.AVX2_LINEAR_ENV, "1")
    low = _packed_dtype() if precision == "packed" else "float32"
    if cpu_kernels.projections(torch.device("cpu"), getattr(torch, low)) is None:
        pytest.skip(f"no {low} projection kernel for this CPU (AMX-BF16, AVX-512 or AVX2)")
    model_dir = tiny_model_dir if model == "tiny" else request.getfixturevalue("smollm2_dir")
    lm = load_model(model_dir, low).eval()
    pack_linears(lm)
    lm.config._attn_implementation = ATTENTION
    dec = fused_decode.FusedDecoder(lm)
    one_call = dec._layers_op
    assert one_call is not None and dec._proj is not None
    vocab = lm.config.vocab_size
    prompts = [[1, (7 + i) % vocab, 8, 9, (10 + 3 * i) % vocab][: 3 + i % 3] for i in range(20)]
    calls = []

    def steps(in_one_call: bool) -> tuple[list[torch.Tensor], SlotCache]:
        dec._layers_op = (lambda *a: calls.append(a[8]) or one_call(*a)) if in_one_call else None
        with torch.no_grad():
            layers_kv, mask, last = forest_prefill(lm, prompts, torch.device("cpu"))
            slots = SlotCache(len(layers_kv), layers_kv[0][0].shape[1], layers_kv[0][0].shape[3],
                              layers_kv[0][0].dtype, torch.device("cpu"), keys_blocked=True)
            slots.join(layers_kv, mask, torch.arange(len(prompts)))
            tokens, positions, out = last.argmax(-1), mask.sum(-1), []
            for _ in range(3):
                out.append(dec(tokens, positions, slots.decode_mask(), slots))
                slots.advance()
                tokens, positions = out[-1].argmax(-1), positions + 1
        return out, slots

    first: list[torch.Tensor] = []
    for update in (False, True):
        if update:  # new tensors, as the engine loads them (norm weights included)
            g = torch.Generator().manual_seed(2)
            state = {f"model.layers.{k}": v + (0.02 * torch.randn(v.shape, generator=g)).to(v.dtype)
                     for k, v in lm.model.layers.state_dict().items()}
            lm.load_state_dict(state, strict=False, assign=True)
            repack(lm)
            dec._layers_op = one_call
            dec.refresh()
        calls.clear()
        fused, fused_slots = steps(True)
        assert calls == [dec._proj.op] * 3
        looped, looped_slots = steps(False)
        for a, b in zip(fused, looped, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(_cached(fused_slots, "keys"), _cached(looped_slots, "keys"))
        assert torch.equal(_cached(fused_slots, "values"), _cached(looped_slots, "values"))
        first.append(fused[0])
    assert not torch.equal(*first), "the call's weights must follow the update"


def _cached(slots, which: str) -> torch.Tensor:
    """Every layer's keys or values at the cache's valid columns (the buffers are not zero-filled:
    what lies elsewhere is whatever the memory held), zeros elsewhere."""
    n, lo, hi = slots.size, slots.lo, slots.hi
    held = getattr(slots, which)[:, :n, :, lo:hi]  # [layers, rows, heads, columns, dim]
    return held.masked_fill(~slots.valid[:n, lo:hi].view(1, n, 1, -1, 1), 0)


@pytest.mark.parametrize("outcome", ["as_timed", "won_1_and_64", "won_none"])
def test_a_measured_projection_kernel_decodes_only_at_the_batches_it_won(tiny_model_dir, monkeypatch,
                                                                         outcome, tmp_path):
    """Left to choose (OOLONG_AVX512_LINEAR unset), the decoder times the AVX-512 (AVX2) kernel against
    oneDNN's on its own weights; it then decodes on the kernel exactly at the batch sizes it won,
    and keeps no copy of the weights for it where it won none. The timing's outcome as it comes
    on this CPU, and two set ones (a partial win, none). Either way the step is the same step:
    its greedy tokens are transformers'."""
    from training_core.rollout_server import cpu_kernels, fused_decode
    from training_core.rollout_server.packed_linear import pack_linears
    from training_core.rollout_server.prefill import forest_prefill
    from training_core.rollout_server.slot_cache import ATTENTION, SlotCache

    monkeypatch.delenv(cpu_kernels.AVX512_LINEAR_ENV, raising=False)
    monkeypatch.delenv(cpu_kernels.AVX2_LINEAR_ENV, raising=False)
    monkeypatch.setenv(cpu_kernels.AMX_ENV, "0")
    low = _packed_dtype()
    offered = cpu_kernels.projections(torch.device("cpu"), getattr(torch, low))
    if offered is None:
        pytest.skip("no AVX-512 or AVX2 projection kernel for this CPU")
    assert offered.measure
    lm = load_model(tiny_model_dir, low).eval()
    pack_linears(lm)
    lm.config._attn_implementation = ATTENTION
    timed = []
    real = cpu_kernels.measured

    def measured(kernel, kernel_step, onednn_step):
        timed.append(kernel.name)
        for rows in (1, 64):  # the steps the decoder hands over run at any batch size
            kernel_step(rows)
            onednn_step(rows)
        if outcome == "as_timed":
            return real(kernel, kernel_step, onednn_step)
        return (dataclasses.replace(kernel, measure=False, won=frozenset({1, 64}))
                if outcome == "won_1_and_64" else None)

    monkeypatch.setattr(cpu_kernels, "measured", measured)
    monkeypatch.setattr(cpu_kernels, "choices_file", lambda: tmp_path / "choices.json")
    dec = fused_decode.FusedDecoder(lm)
    assert timed == [offered.name]
    # recorded: a second decoder of this machine takes the same choice without timing again
    again = fused_decode.FusedDecoder(lm)
    assert timed == [offered.name]
    assert (again._proj is None) == (dec._proj is None)
    assert again._proj is None or (again._proj.name, again._proj.won) == (dec._proj.name, dec._proj.won)
    if outcome == "won_none":
        assert dec._proj is None
    if dec._proj is None:
        assert dec._proj_layers is None and dec._proj_head is None and dec._norm_weights is None
    else:
        assert not dec._proj.measure and dec._proj.won <= set(cpu_kernels.CALIBRATION_ROWS)
        assert all(len(kind) == lm.config.num_hidden_layers for kind in dec._proj_layers)
        real_linear, real_layers = dec._proj.linear, dec._layers_op
        if real_layers is not None:  # the layers in one call: the kernel by name, counted here
            dec._layers_op = lambda *a: calls.append(a[0].shape[0]) or real_layers(*a)
        dec._proj = dataclasses.replace(dec._proj, linear=lambda *a: calls.append(a[0].shape[0])
                                        or real_linear(*a))
    calls = []
    for rows in (1, 5, 16, 70):
        calls.clear()
        prompts = [[1, 7 + i, 8, 9][: 2 + i % 3] for i in range(rows)]
        with torch.no_grad():
            layers_kv, mask, last = forest_prefill(lm, prompts, torch.device("cpu"))
            slots = SlotCache(len(layers_kv), layers_kv[0][0].shape[1], layers_kv[0][0].shape[3],
                              layers_kv[0][0].dtype, torch.device("cpu"),
                              keys_blocked=dec.uses_kernels)
            slots.join(layers_kv, mask, torch.arange(rows))
            tokens = last.argmax(-1)
            logits = dec(tokens, mask.sum(-1), slots.decode_mask(), slots)
            full = [p + [int(t)] for p, t in zip(prompts, tokens, strict=True)]
            _, _, reference = forest_prefill(lm, full, torch.device("cpu"))
        on_kernel = dec._proj is not None and cpu_kernels._bucket(rows) in dec._proj.won
        if outcome == "won_1_and_64":
            assert on_kernel == (rows in (1, 70))
        assert bool(calls) == on_kernel and set(calls) <= {rows}
        assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


def test_measured_keeps_the_batch_sizes_where_the_kernel_was_faster(monkeypatch):
    """cpu_kernels.measured on steps whose durations are set, on a clock of the test's own: the
    kernel slower at 4 and 16 rows, faster elsewhere; then slower everywhere; then within the win
    margin of oneDNN's time, which is no win."""
    import types

    from training_core.rollout_server import cpu_kernels

    now = [0.0]
    monkeypatch.setattr(cpu_kernels, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def step(seconds):
        return lambda rows: now.__setitem__(0, now[0] + seconds(rows))

    offered = cpu_kernels.Projections("avx512", lambda w: w, lambda *a: None, "avx512_linear", measure=True)
    onednn = step(lambda rows: 0.010)
    chosen = cpu_kernels.measured(offered, step(lambda rows: 0.03 if rows in (4, 16) else 0.005),
                                  onednn)
    assert chosen.won == {1, 64} and not chosen.measure
    assert [b for b in (1, 3, 4, 15, 16, 63, 64, 200) if chosen.serves(b)] == [1, 3, 64, 200]
    assert chosen.describe() == "avx512 at 1-3, 64+ rows"
    assert cpu_kernels.measured(offered, step(lambda rows: 0.02), onednn) is None
    near_tie = step(lambda rows: 0.010 * (cpu_kernels.WIN_MARGIN + 0.01))
    assert cpu_kernels.measured(offered, near_tie, onednn) is None


def test_prefill_attention_by_blocks_of_queries_is_attention_over_the_whole_row():
    """The fused prefill's attention (fused_decode._attention_blocks): each block of queries over
    only the columns it attends gives what SDPA gives over the whole forest row, for every real
    node, in far fewer columns (a forest of prompts sharing a prefix, rows of many branches)."""
    from training_core.prefix_tree import prefill_forest
    from training_core.rollout_server.fused_decode import PREFILL_QUERY_BLOCK, _attention_blocks

    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 90, (20,), generator=g).tolist()
    seqs = [shared + torch.randint(3, 90, (int(n),), generator=g).tolist()
            for n in torch.randint(4, 30, (40,), generator=g)]
    forest = prefill_forest(seqs, 200)
    mask = forest.allowed
    rows, _, width, _ = mask.shape
    assert width > 2 * PREFILL_QUERY_BLOCK
    q = torch.randn(rows, 6, width, 16, generator=g)
    k, v = torch.randn(rows, 2, width, 16, generator=g), torch.randn(rows, 2, width, 16, generator=g)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    whole = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    blocks = _attention_blocks(mask)
    by_blocks = torch.cat([sdpa(q[:, :, start: start + m.shape[2]], k.index_select(2, cols),
                                v.index_select(2, cols), attn_mask=m, enable_gqa=True)
                           for start, cols, m in blocks], 2)
    assert mask.any(-1).all(), "every node attends itself (padding too): no empty row or block"
    torch.testing.assert_close(by_blocks, whole, atol=1e-6, rtol=1e-5)
    read = sum(m.shape[2] * m.shape[3] for _, _, m in blocks)
    assert read < 0.6 * width * width, (read, width)
