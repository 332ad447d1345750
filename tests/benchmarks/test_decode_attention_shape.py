"""benchmarks/decode_attention.py's JSON, from its report function (no timing is asserted), and
its two paths computing the same attention on a small step, so the comparison is of like with
like."""

from __future__ import annotations

import json

import pytest
import torch

from tests.benchmarks.modules import benchmark
from training_core.rollout_server import cpu_kernels


def test_the_report_has_medians_speedup_and_read_rate_per_precision():
    bench = benchmark("decode_attention")
    measured = {"bfloat16": {"kernel": [10.0, 12.0, 11.0], "torch": [30.0, 36.0, 33.0], "kv_bytes": 110_000_000},
                "float32": {"kernel": [20.0], "torch": [40.0], "kv_bytes": 220_000_000}}
    out = bench.report(measured, {"columns": 128}, {"threads": 2, "read_gb_s": 20.0})
    json.dumps(out)
    by = {r["precision"]: r for r in out["runs"]}
    assert list(by) == ["bfloat16", "float32"]
    assert by["bfloat16"]["kernel_ms"] == 11.0 and by["bfloat16"]["torch_ms"] == 33.0
    assert by["bfloat16"]["speedup"] == pytest.approx(3.0)
    assert by["bfloat16"]["kernel_gb_s"] == pytest.approx(10.0)  # 110 MB in 11 ms
    assert by["float32"]["kv_mb"] == pytest.approx(220.0)
    assert by["float32"]["kernel_ms_rounds"] == [20.0]
    assert out["machine"]["read_gb_s"] == 20.0 and out["config"] == {"columns": 128}


@pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ toolchain to build with")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_both_paths_write_the_same_column_and_attend_alike(dtype, monkeypatch):
    bench = benchmark("decode_attention")
    step = bench.Step(dtype, columns=40, layers=1)
    def by_column(blocks: torch.Tensor) -> torch.Tensor:  # [R, KV, C / 32, D, 32] -> [R, KV, C, D]
        return blocks.transpose(-1, -2).reshape(bench.ROWS, bench.KV_HEADS, -1, bench.DIM)

    step.keys[0].copy_(by_column(step.key_blocks[0]))  # one cache, in both layouts
    outputs = {}
    op = cpu_kernels.decode_attention(bench.DIM, torch.device("cpu"))
    kernel_out = op(step.q, step.k_new, step.v_new, step.cos, step.signed_sin, step.key_blocks[0], step.values[0].clone(),
                    step.bias, step.column, bench.DIM ** -0.5)
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(bench.F, "scaled_dot_product_attention",
                        lambda *a, **k: outputs.setdefault("torch", real_sdpa(*a, **k)))
    bench.torch_ms(step)
    torch_out = outputs["torch"].view(bench.ROWS, bench.HEADS, bench.DIM)
    torch.testing.assert_close(by_column(step.key_blocks[0])[:, :, step.column].float(),
                               step.keys[0][:, :, step.column].float(), atol=2e-2, rtol=2e-2)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(kernel_out.float(), torch_out.float(), atol=tol, rtol=tol)
