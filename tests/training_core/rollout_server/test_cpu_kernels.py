"""The engine's CPU kernels (cpu_kernels.py, kernels/decode_step.cpp) against torch: decode
attention over the same cache for every head size and query group it serves, fp32 and bf16,
rows with left padding and gaps, keys in blocks of 32 columns, the cache seen as views of wider
buffers, the rotary
embedding applied, the step's key and value written at their column and nothing else touched;
RMSNorm against transformers' LlamaRMSNorm; and the build cache keyed by the CPU it was built
on."""

from __future__ import annotations

import pytest
import torch

from training_core.rollout_server import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ toolchain to build with")


def _rotate(x, cos, sin):
    """transformers' rotary embedding: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _reference(q, k_new, v_new, cos, sin, keys, values, bias, column, scale):
    """torch in fp64 over the cache with the step's (rotated) key and value written in."""
    cos, sin = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    q, k_new = _rotate(q.double(), cos, sin), _rotate(k_new.double(), cos, sin)
    keys, values = keys.clone(), values.clone()
    keys[:, :, column], values[:, :, column] = k_new.to(keys.dtype), v_new
    b, heads, dim = q.shape
    kv = keys.shape[1]
    # masked columns hold nan in the test: they must not count, so the reference zeroes them
    scores = torch.einsum("bkgd,bkcd->bkgc", q.double().view(b, kv, heads // kv, dim),
                          keys.double().nan_to_num(0.0)) * scale + bias.double().view(b, 1, 1, -1)
    out = torch.einsum("bkgc,bkcd->bkgd", torch.softmax(scores, -1),
                       values.double().nan_to_num(0.0))
    return out.reshape(b, heads, dim), keys, values


def _by_column(key_blocks: torch.Tensor) -> torch.Tensor:
    """[B, KV, C / 32, D, 32] -> a view [B, KV, C / 32, 32, D]: column c at [..., c // 32, c % 32]."""
    return key_blocks.transpose(-1, -2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim,heads,kv", [(64, 9, 3), (32, 4, 4), (16, 8, 2), (128, 8, 2),
                                          (64, 12, 4), (32, 5, 1), (64, 6, 3)])
@pytest.mark.parametrize("window", [False, True], ids=["full", "window"])
def test_attention_and_the_cache_write_match_torch(dtype, dim, heads, kv, window):
    g = torch.Generator().manual_seed(dim * heads + kv)
    rows, cols = 9, 83  # attended up to 83: not a multiple of the kernel's blocks
    blocks = 3  # the buffers' width, 96 columns; the last 13 are masked
    width = blocks * 32
    # The engine's layout: keys in blocks of 32 columns, values as they are; with ``window``
    # both are views of wider buffers (strided rows), as the engine's are of its growing buffers
    store_k = torch.randn(rows, kv, blocks + 1, dim, 32, generator=g).to(dtype)
    store_v = torch.randn(rows, kv, width + 20, dim, generator=g).to(dtype)
    lo = 11 if window else 0
    key_blocks = store_k[:, :, :blocks] if window else store_k[:, :, 1:].contiguous()
    values = store_v[:, :, lo: lo + width]
    column = cols - 1
    valid = torch.zeros(rows, width, dtype=torch.bool)
    for r in range(7):  # left padding of every length, one row with a gap
        valid[r, r * 9: cols] = True
    valid[3, 40:45] = False
    valid[7, 70:width] = True  # starts in the last block and attends up to the buffer's end
    valid[8, 64:75] = True  # one block, in fp32 a single step of 16 columns
    bias = torch.zeros(rows, width).masked_fill_(~valid, float("-inf"))
    by_column = _by_column(key_blocks)
    for r in range(rows):  # whatever masked columns hold stays out (nan would spread)
        for c in (~valid[r]).nonzero().flatten().tolist():
            by_column[r, :, c // 32, c % 32] = float("nan")
        values[r, :, ~valid[r]] = float("nan")

    def logical(kb: torch.Tensor) -> torch.Tensor:  # [B, KV, C, D]
        return _by_column(kb).reshape(rows, kv, width, dim)

    qkv = torch.randn(rows, heads + 2 * kv, dim, generator=g).to(dtype)
    q, k_new, v_new = qkv[:, :heads], qkv[:, heads: heads + kv], qkv[:, heads + kv:]
    angles = torch.rand(rows, dim // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    signed_sin = torch.cat([-sin[:, : dim // 2], sin[:, dim // 2:]], -1)  # what the kernel takes
    want, want_k, want_v = _reference(q, k_new, v_new, cos, sin, logical(key_blocks), values,
                                      bias, column, dim ** -0.5)
    before_k, before_v, before_kb = store_k.clone(), store_v.clone(), key_blocks.clone()

    op = cpu_kernels.decode_attention(dim, torch.device("cpu"))
    got = op(q, k_new, v_new, cos, signed_sin, key_blocks, values, bias, column, dim ** -0.5)

    assert got.dtype == dtype and got.shape == (rows, heads, dim)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    # the step's key and value landed at their column, in the buffer, and nothing else moved
    if dtype == torch.float32:
        torch.testing.assert_close(logical(key_blocks), want_k, atol=1e-6, rtol=1e-6,
                                   equal_nan=True)
    else:  # the rotated key rounded once to bf16 (fp64 reference, fp32 kernel: at most 1 ulp)
        torch.testing.assert_close(logical(key_blocks).float(), want_k.float(), atol=0,
                                   rtol=2 ** -7, equal_nan=True)
    torch.testing.assert_close(values, want_v.to(dtype), atol=0, rtol=0, equal_nan=True)
    other = torch.ones(width, dtype=torch.bool)
    other[column] = False
    torch.testing.assert_close(logical(key_blocks)[:, :, other], logical(before_kb)[:, :, other],
                               atol=0, rtol=0, equal_nan=True)
    if window:  # the block past the view untouched
        torch.testing.assert_close(store_k[:, :, blocks:], before_k[:, :, blocks:], atol=0, rtol=0)
    other_v = torch.ones(width + 20, dtype=torch.bool)
    other_v[lo + column] = False
    torch.testing.assert_close(store_v[:, :, other_v], before_v[:, :, other_v], atol=0, rtol=0,
                               equal_nan=True)


def test_bad_shapes_are_refused_with_the_reason():
    op = cpu_kernels.decode_attention(64, torch.device("cpu"))
    q = torch.randn(2, 9, 64)
    kv = torch.randn(2, 3, 64)
    key_blocks, values = torch.randn(2, 3, 1, 64, 32), torch.randn(2, 3, 32, 64)
    cs = torch.ones(2, 64)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        op(q, kv, kv, cs, cs, key_blocks, values, torch.zeros(2, 33), 9, 0.125)
    with pytest.raises(RuntimeError, match="column outside the cache"):
        op(q, kv, kv, cs, cs, key_blocks, values, torch.zeros(2, 32), 32, 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        op(q.bfloat16(), kv, kv, cs, cs, key_blocks, values, torch.zeros(2, 32), 9, 0.125)
    with pytest.raises(RuntimeError, match="cos and sin"):
        op(q, kv, kv, cs[:, :32], cs[:, :32], key_blocks, values, torch.zeros(2, 32), 9, 0.125)
    with pytest.raises(RuntimeError, match="blocks of 32 columns"):  # a block's rows apart
        op(q, kv, kv, cs, cs, torch.randn(2, 3, 1, 64, 40)[..., :32], values, torch.zeros(2, 32),
           9, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_is_transformers_llama_rms_norm(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(5)
    norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
        hidden = (torch.randn(40, 600, generator=g) * 3).to(dtype)[:, :576]  # strided rows
        want = norm(hidden)
    got = cpu_kernels.rms_norm(torch.device("cpu"))(hidden, norm.weight, norm.variance_epsilon)
    assert got.dtype == dtype
    # fp32: the sum in another order; bf16: the same two roundings, so at most one ulp apart
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    if dtype == torch.bfloat16:
        assert (got != want).float().mean() < 0.01


def test_no_kernel_for_other_devices_or_head_sizes_or_when_switched_off(monkeypatch):
    assert cpu_kernels.decode_attention(48, torch.device("cpu")) is None
    assert cpu_kernels.decode_attention(64, torch.device("meta")) is None
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    monkeypatch.setenv(cpu_kernels.CPU_KERNELS_ENV, "0")
    assert cpu_kernels.decode_attention(64, torch.device("cpu")) is None


def test_a_build_is_kept_per_cpu(monkeypatch):
    """A cache copied to a machine with other instructions must not run there (-march=native)."""
    here = cpu_kernels.build_dir()
    monkeypatch.setattr(cpu_kernels, "cpu_info", lambda: ("another", frozenset({"fpu", "sse2"})))
    assert cpu_kernels.build_dir() != here
    assert cpu_kernels.build_dir().parent == here.parent


def test_a_build_killed_midway_does_not_stop_the_next_one(tmp_path):
    """torch's builder leaves its lock file behind when its process is killed, and the next
    builder would wait on it forever: the engine's own lock makes it safe to remove. (Built in
    a child process: a second library registering the same operators would abort this one.) The
    lock is what is tested, so the build is of one small source, not the kernels (a minute or
    three of compiling on a 2-core machine)."""
    import os
    import subprocess
    import sys

    small = tmp_path / "small.cpp"
    small.write_text("extern \"C\" int oolong_small_build() { return 1; }\n")
    env = {**os.environ, "OOLONG_CACHE": str(tmp_path)}
    code = ("from training_core.rollout_server import cpu_kernels as k; "
            f"k.SOURCES, k.HEADERS = [__import__('pathlib').Path({str(small)!r})], []; "
            "t = k.build_dir(); "
            "t.mkdir(parents=True); (t / 'lock').write_text(''); "  # what a killed build leaves
            "k._build(t, t / 'built'); print(t)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)  # a wait on the dead builder's lock would run into this
    assert out.returncode == 0, out.stderr[-2000:]
    target = tmp_path / "kernels" / os.path.basename(out.stdout.strip())
    assert (target / "built").exists() and (target / "oolong_kernels.so").exists()
