"""The engine's projection kernels and its sampling kernel (cpu_kernels.py, kernels/amx_linear.cpp,
kernels/avx512_linear.cpp, kernels/avx2_linear.cpp, kernels/decode_step.cpp) against what they
replace: AMX's against oneDNN's packed linear layers with their fused post-ops, bitwise, for every
batch size (ragged ones padded inside); AVX-512's and AVX2's, bf16 and fp32, against the exact
product rounded once; their
refusals; which one serves; and generation_engine's torch draw, token for token from the same
uniforms (that every token keeps its probability over a large vocabulary is
test_generation_engine's interval test, run on both)."""

from __future__ import annotations

import json

import pytest
import torch

from training_core.rollout_server import cpu_kernels, generation_engine

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ toolchain to build with")

AMX = cpu_kernels.amx_linear(torch.device("cpu"), torch.bfloat16)
needs_amx = pytest.mark.skipif(AMX is None, reason="this CPU (or its compiler) has no AMX-BF16")
_linear = torch.ops.mkldnn._linear_pointwise


def _onednn(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, 16)


@needs_amx
@pytest.mark.parametrize("rows", [1, 17, 64, 100])
def test_amx_projections_are_onednns_with_their_post_ops(rows):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(96, 160, generator=g) * 0.1).bfloat16()  # five blocks of K, three of N
    x = torch.randn(rows, 160, generator=g).bfloat16()
    residual = torch.randn(rows, 96, generator=g).bfloat16()
    packed = torch.ops.oolong.amx_pack(w)

    plain = AMX(x, packed, None, "none")
    assert plain.shape == (rows, 96) and plain.dtype == torch.bfloat16
    assert torch.equal(plain, _linear(x, _onednn(w), None, "none", [], ""))
    torch.testing.assert_close(plain.float(), x.float() @ w.float().T, atol=0.02, rtol=0.01)
    added = AMX(x, packed, residual, "add")  # the residual added before the one rounding
    assert torch.equal(added, _linear.binary(x, residual, _onednn(w), None, "add"))

    gate, up = w[:48], w[48:]
    from training_core.rollout_server.fused_decode import _interleave

    fused = AMX(x, torch.ops.oolong.amx_pack(_interleave(gate, up)), None, "silu_mul")
    want = _linear.binary(x, _linear(x, _onednn(gate), None, "swish", [], ""), _onednn(up), None,
                          "mul")
    assert fused.shape == (rows, 48)
    # SiLU's exp is the kernel's own: an output may land one bf16 step from oneDNN's
    assert (fused != want).float().mean() < 0.02
    torch.testing.assert_close(fused.float(), want.float(), atol=0.02, rtol=2 ** -7)


def test_no_amx_kernel_for_fp32_or_other_devices_or_when_switched_off(monkeypatch):
    assert cpu_kernels.amx_linear(torch.device("cpu"), torch.float32) is None
    assert cpu_kernels.amx_linear(torch.device("meta"), torch.bfloat16) is None
    monkeypatch.setenv(cpu_kernels.AMX_ENV, "0")
    assert cpu_kernels.amx_linear(torch.device("cpu"), torch.bfloat16) is None
    assert cpu_kernels.sample(torch.device("meta"), torch.float32) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_sampling_kernel_draws_what_torch_draws_from_the_same_uniforms(dtype):
    g = torch.Generator().manual_seed(11)
    rows, vocab = 24, 5 * generation_engine.DRAW_CHUNK + 37  # a ragged last block
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    logits[0, 100] = 40.0  # a nearly certain token
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.2
    temperature[[2, 5]] = 0.0  # greedy rows
    temperature[3] = 1.0
    u = torch.rand(rows, generator=g, dtype=torch.float64)

    tokens, logprobs = cpu_kernels.sample(torch.device("cpu"), dtype)(
        logits, temperature, u, generation_engine.DRAW_CHUNK)

    scale = torch.where(temperature > 0, temperature, torch.ones(()))
    tempered = torch.softmax(logits.float() / scale.view(-1, 1), -1)
    want = generation_engine.draw(tempered, u)
    want[[2, 5]] = logits[[2, 5]].argmax(-1)
    assert torch.equal(tokens, want)
    torch.testing.assert_close(logprobs, tempered.gather(1, want.view(-1, 1)).log().view(-1),
                               atol=1e-5, rtol=1e-5)


def test_the_engine_samples_through_the_kernel_unless_rows_are_truncated(monkeypatch):
    calls = []
    real = cpu_kernels.sample

    def counting(device, dtype):
        op = real(device, dtype)
        return None if op is None else lambda *a: calls.append(1) or op(*a)

    monkeypatch.setattr(cpu_kernels, "sample", counting)
    logits = torch.randn(3, 50)
    seqs = [generation_engine.Seq("s", [1], 1, 1.0, 1.0, -1, set(), False, None, None)] * 3
    generation_engine._sample(logits, seqs, torch.Generator().manual_seed(0))
    assert calls == [1]
    truncated = [generation_engine.Seq("s", [1], 1, 1.0, 0.9, -1, set(), False, None, None)] * 3
    generation_engine._sample(logits, truncated, torch.Generator().manual_seed(0))
    assert calls == [1], "top-p rows take torch's path"
    # float16 logits (a float16 model) take torch's path too: the kernel reads fp32 and bf16
    tokens, logprobs = generation_engine._sample(logits.half(), seqs,
                                                 torch.Generator().manual_seed(0))
    assert calls == [1] and tokens.shape == (3,) and torch.isfinite(logprobs).all()


def test_the_sampling_kernel_refuses_bad_inputs_with_the_reason():
    op = cpu_kernels.sample(torch.device("cpu"), torch.float32)
    logits, u = torch.randn(2, 64), torch.rand(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="temperature"):
        op(logits, torch.ones(3), u, 32)
    with pytest.raises(RuntimeError, match="u: "):
        op(logits, torch.ones(2), u.float(), 32)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        op(logits, torch.ones(2), u, 20)


AVX512 = cpu_kernels.avx512_linear(torch.device("cpu"), torch.bfloat16)
needs_avx512 = pytest.mark.skipif(AVX512 is None, reason="this CPU (or its compiler) has no AVX-512 with BF16")
AVX2 = cpu_kernels.avx2_linear(torch.device("cpu"), torch.bfloat16)
needs_avx2 = pytest.mark.skipif(AVX2 is None, reason="this CPU (or its compiler) has no AVX2 with FMA")


@needs_avx512
@pytest.mark.parametrize("pairs", [False, True], ids=["widened", "pairs"])
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 64, 100])
def test_avx512_projections_round_the_exact_product_once_with_their_epilogues(rows, pairs):
    """Both bf16 layouts, whichever this CPU is given (the widened values' fp32 multiply-adds, or
    vdpbf16ps on pairs of k): the products are exact, the sums fp32, the result rounded once."""
    g = torch.Generator().manual_seed(rows)
    # a chunk of K and a shorter one: widened K 200 (128 k and 72), in pairs K 1,100 (512 pairs and
    # 38); N 96: three panels
    k = 1100 if pairs else 200
    w = (torch.randn(96, k, generator=g) * 0.1).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    residual = torch.randn(rows, 96, generator=g).bfloat16()
    packed = torch.ops.oolong.avx512_pack(w, pairs)
    assert packed.shape == ((3, k // 2, 64) if pairs else (3, k, 32))
    exact = x.double() @ w.double().T  # bf16 products are exact in fp32; fp32 sums, one rounding

    plain = AVX512(x, packed, None, "none")
    assert plain.shape == (rows, 96) and plain.dtype == torch.bfloat16
    torch.testing.assert_close(plain.double(), exact, atol=1e-5, rtol=2 ** -8)
    added = AVX512(x, packed, residual, "add")  # the residual added before the one rounding
    torch.testing.assert_close(added.double(), exact + residual.double(), atol=1e-5, rtol=2 ** -8)

    from training_core.rollout_server.fused_decode import _interleave

    gate, up = w[:48], w[48:]
    fused = AVX512(x, torch.ops.oolong.avx512_pack(_interleave(gate, up), pairs), None, "silu_mul")
    want = _linear.binary(x, _linear(x, _onednn(gate), None, "swish", [], ""), _onednn(up), None, "mul")
    assert fused.shape == (rows, 48)
    torch.testing.assert_close(fused.float(), want.float(), atol=0.02, rtol=2 ** -6)


@pytest.mark.parametrize("name", ["amx", "avx512", "avx2"])
def test_projection_kernels_refuse_what_they_cannot_compute_and_say_why(name):
    op = {"amx": AMX, "avx512": AVX512, "avx2": AVX2}[name]
    if op is None:
        pytest.skip(f"this CPU (or its compiler) has no {name} projection kernel")
    pack = torch.ops.oolong.amx_pack if name == "amx" else torch.ops.oolong.avx512_pack
    with pytest.raises(RuntimeError, match="multiple"):  # of 32: N for both, K for AMX too
        pack(torch.zeros(48, 48, dtype=torch.bfloat16))
    packed = pack(torch.zeros(64, 64, dtype=torch.bfloat16))
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="x has 32 columns"):
        op(x[:, :32], packed, None, "none")
    with pytest.raises(RuntimeError, match="epilogue"):
        op(x, packed, None, "relu")
    with pytest.raises(RuntimeError, match="other must be"):
        op(x, packed, torch.zeros(4, 32, dtype=torch.bfloat16), "add")
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(x.float(), packed, None, "none")
    with pytest.raises(RuntimeError, match="K > 0"):  # an empty product, not uninitialised memory
        op(x[:, :0], pack(torch.zeros(64, 0, dtype=torch.bfloat16)), torch.zeros(4, 64, dtype=torch.bfloat16), "add")
    if name == "avx512":  # vdpbf16ps's pairs of k: an even K, bf16
        with pytest.raises(RuntimeError, match="K must be even, got 63"):
            pack(torch.zeros(64, 63, dtype=torch.bfloat16), True)
        with pytest.raises(RuntimeError, match="bf16 weights only"):
            pack(torch.zeros(64, 64), True)
        with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
            op(x[:, :32], pack(torch.zeros(64, 64, dtype=torch.bfloat16), True), None, "none")
    if name == "avx2":  # the widened and fp32 layouts only
        with pytest.raises(RuntimeError, match="not its pairs"):
            op(x, pack(torch.zeros(64, 64, dtype=torch.bfloat16), True), None, "none")


def test_the_projection_kernel_is_amxs_else_avx512s_else_avx2s_else_none(monkeypatch):
    """AMX's serves 17+ rows as it is; AVX-512's (or, on a CPU without it, AVX2's) is offered to
    be measured against oneDNN's (fused_decode times both), or at every batch with
    OOLONG_AVX512_LINEAR=1 (OOLONG_AVX2_LINEAR=1)."""
    cpu = torch.device("cpu")
    monkeypatch.delenv("OOLONG_AVX512_LINEAR", raising=False)
    monkeypatch.delenv("OOLONG_AVX2_LINEAR", raising=False)
    fp32 = cpu_kernels.projections(cpu, torch.float32)  # AMX's kernel is bf16 only
    simd = "avx512" if AVX512 is not None else "avx2" if AVX2 is not None else None
    assert fp32 is None if simd is None else (fp32.name == simd and fp32.measure and fp32.serves(1))
    assert cpu_kernels.projections(cpu, torch.float16) is None
    assert cpu_kernels.projections(torch.device("meta"), torch.bfloat16) is None
    chosen = cpu_kernels.projections(cpu, torch.bfloat16)
    if AMX is not None:
        assert chosen.name == "amx" and not chosen.measure
        assert not chosen.serves(cpu_kernels.AMX_MIN_ROWS - 1) and chosen.serves(cpu_kernels.AMX_MIN_ROWS)
    elif AVX512 is not None:  # bf16 in pairs where vdpbf16ps outruns widening on this CPU
        # the rates timed once per machine and recorded: every server packs alike
        pairs = json.loads(cpu_kernels.choices_file().read_text())["avx512_dot_pairs_faster"]
        assert chosen.name == ("avx512-pairs" if pairs else "avx512") and chosen.measure
        w = torch.zeros(64, 96, dtype=torch.bfloat16)
        assert chosen.pack(w).shape == ((2, 48, 64) if pairs else (2, 96, 32))
        assert chosen.pack(torch.zeros(64, 95, dtype=torch.bfloat16)).shape == (2, 95, 32)
    elif AVX2 is not None:  # a CPU without AVX-512: the AVX2 kernel, measured, widened bf16
        assert chosen.name == "avx2" and chosen.measure
        assert chosen.pack(torch.zeros(64, 96, dtype=torch.bfloat16)).shape == (2, 96, 32)
    else:
        assert chosen is None
    monkeypatch.setenv("OOLONG_AVX512_LINEAR", "1")
    forced = cpu_kernels.projections(cpu, torch.float32)
    assert (forced is None if AVX512 is None and AVX2 is None else forced.name == "avx2" and forced.measure
            if AVX512 is None else not forced.measure)
    monkeypatch.setenv("OOLONG_AVX2_LINEAR", "1")
    if AVX512 is None and AVX2 is not None:
        assert not cpu_kernels.projections(cpu, torch.float32).measure
    monkeypatch.setenv("OOLONG_AMX", "0")
    without_amx = cpu_kernels.projections(cpu, torch.bfloat16)
    assert (without_amx.name.startswith("avx512") if AVX512 is not None
            else without_amx.name == "avx2" if AVX2 is not None else without_amx is None)
    monkeypatch.setenv("OOLONG_AVX512_LINEAR", "0")
    if AVX512 is not None:  # where it is built, AVX2's does not stand in for it
        assert cpu_kernels.projections(cpu, torch.float32) is None
    monkeypatch.setenv("OOLONG_AVX2_LINEAR", "0")
    assert cpu_kernels.projections(cpu, torch.bfloat16) is None
    assert cpu_kernels.projections(cpu, torch.float32) is None


@needs_avx512
@pytest.mark.parametrize("rows", [1, 13, 64])
def test_avx512_projections_in_fp32_are_the_exact_product_up_to_fp32_sums(rows):
    from training_core.rollout_server.fused_decode import _interleave

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 200, generator=g) * 0.1  # a chunk of 64 k, and more: four chunks
    x = torch.randn(rows, 200, generator=g)
    residual = torch.randn(rows, 96, generator=g)
    packed = torch.ops.oolong.avx512_pack(w)
    exact = x.double() @ w.double().T
    plain = AVX512(x, packed, None, "none")
    assert plain.dtype == torch.float32 and plain.shape == (rows, 96)
    torch.testing.assert_close(plain.double(), exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(AVX512(x, packed, residual, "add").double(), exact + residual.double(),
                               atol=1e-5, rtol=1e-5)
    gate, up = w[:48], w[48:]
    fused = AVX512(x, torch.ops.oolong.avx512_pack(_interleave(gate, up)), None, "silu_mul")
    want = torch.nn.functional.silu(x.double() @ gate.double().T) * (x.double() @ up.double().T)
    torch.testing.assert_close(fused.double(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="float32"):  # x in the packed weight's dtype
        AVX512(x.bfloat16(), packed, None, "none")


@needs_avx2
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 16, 64, 100])
def test_avx2_projections_are_the_exact_product_with_their_epilogues(rows, dtype):
    """Passes of one to six rows by half panels, K in chunks (200: fp32 64 k a chunk, four of
    them; widened bf16 128, two): the products exact, the sums fp32, bf16 rounded once."""
    from training_core.rollout_server.fused_decode import _interleave

    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(96, 200, generator=g) * 0.1).to(dtype)  # three panels of 32 columns
    x = torch.randn(rows, 200, generator=g).to(dtype)
    residual = torch.randn(rows, 96, generator=g).to(dtype)
    packed = torch.ops.oolong.avx512_pack(w)
    exact = x.double() @ w.double().T
    # bf16: the one rounding's half step; fp32: the sums' order
    tol = dict(atol=1e-5, rtol=2 ** -8) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    plain = AVX2(x, packed, None, "none")
    assert plain.shape == (rows, 96) and plain.dtype == dtype
    torch.testing.assert_close(plain.double(), exact, **tol)
    added = AVX2(x, packed, residual, "add")  # the residual added before the one rounding
    torch.testing.assert_close(added.double(), exact + residual.double(), **tol)
    gate, up = w[:48], w[48:]
    fused = AVX2(x, torch.ops.oolong.avx512_pack(_interleave(gate, up)), None, "silu_mul")
    assert fused.shape == (rows, 48) and fused.dtype == dtype
    if dtype == torch.float32:
        want = torch.nn.functional.silu(x.double() @ gate.double().T) * (x.double() @ up.double().T)
        torch.testing.assert_close(fused.double(), want, atol=1e-5, rtol=1e-5)
    else:  # transformers' rounding: bf16(bf16(SiLU(gate)) * up)
        silu = torch.nn.functional.silu((x.double() @ gate.double().T).float()).bfloat16()
        want = (silu.float() * (x.double() @ up.double().T).float()).bfloat16()
        torch.testing.assert_close(fused.float(), want.float(), atol=0.02, rtol=2 ** -6)


@needs_avx2
def test_avx2_projections_round_bf16_to_nearest_even_and_keep_nan_and_inf():
    """The epilogue's own rounding (AVX2 has no bf16 conversion) as torch rounds: ties to even,
    overflow to infinity, NaN kept. Each row's sum is x[0] + x[1] in fp32 (both columns of the
    weight 1), then rounded once."""
    w = torch.zeros(32, 32, dtype=torch.bfloat16)
    w[:, :2] = 1.0
    # 1 + 2^-8: halfway between 1 and 1 + 2^-7, to the even 1; 1 + 3 * 2^-8: halfway, up to
    # 1 + 2^-6; 1 + 2^-9: down; bf16's largest plus 1e36, finite in fp32, rounds up to infinity,
    # and its negative to -infinity; infinity; NaN; a negative tie
    big = torch.finfo(torch.bfloat16).max
    x = torch.zeros(9, 32)
    x[:, 0] = torch.tensor([1.0, 1.0, 1.0, big, -big, 1.0, 1.0, -1.0, 0.0])
    x[:, 1] = torch.tensor([2 ** -8, 3 * 2 ** -8, 2 ** -9, 1e36, -1e36, float("inf"), float("nan"),
                            -2 ** -8, 0.0])
    x = x.bfloat16()
    got = AVX2(x, torch.ops.oolong.avx512_pack(w), None, "none")[:, 0]
    total = x[:, 0].float() + x[:, 1].float()
    assert total[3].isfinite() and total[4].isfinite()  # the overflow is the rounding's own
    want = total.bfloat16()  # torch's rounding of the fp32 sum
    assert want[0] == 1.0 and want[1] == 1 + 2 ** -6
    assert want[3] == float("inf") and want[4] == float("-inf")
    nan = want.isnan()
    assert torch.equal(got[~nan], want[~nan]) and got[nan].isnan().all()
