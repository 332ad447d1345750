"""The CPU accelerator (cpu_kernels' C++ kernels, oneDNN's prepacked weights, the fused decode
step) is optional, behind one switch (``OOLONG_CPU_KERNELS``), and torch's path is the
reference: with the switch off the engine decodes through transformers' forward on torch's
operators, and every accelerated path is held to it, on each instruction set this machine has
(a kernel the machine lacks is skipped, by name)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from training_core.models.loading import load_model
from training_core.rollout_server import cpu_kernels, fused_decode
from training_core.rollout_server.generation_engine import GenerationEngine, Seq
from training_core.rollout_server.packed_linear import PackedLinear, pack_linears
from training_core.rollout_server.prefill import forest_prefill
from training_core.rollout_server.slot_cache import ATTENTION, SlotCache

CPU = torch.device("cpu")
PROMPTS = [[1, 7 + i, 8, 9, 10 + 2 * i][: 3 + i % 3] for i in range(20)]  # 20 rows: AMX serves 17+


def _greedy(model_dir, prompts: list[list[int]]) -> list[dict]:
    eng = GenerationEngine(str(model_dir), seed=1)

    async def main():
        loop = asyncio.get_running_loop()
        futures = []
        for i, prompt in enumerate(prompts):
            fut = loop.create_future()
            eng.submit(Seq(f"r{i}", list(prompt), 12, 0.0, 1.0, 0, set(), True, fut, loop))
            futures.append(fut)
        return await asyncio.gather(*futures), eng

    try:
        outs, _ = asyncio.run(main())
        return [{"ids": o["output_ids"], "packed": eng._packed, "fused": eng._fused is not None,
                 "logprobs": [x[0] for x in o["meta_info"]["output_token_logprobs"]]} for o in outs]
    finally:
        eng.shutdown()


def test_the_switch_turns_the_whole_accelerator_off_and_the_paths_agree(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(cpu_kernels.CPU_KERNELS_ENV, "0")
    assert not cpu_kernels.enabled() and not cpu_kernels.load()
    assert cpu_kernels.decode_attention(64, CPU) is None and cpu_kernels.rms_norm(CPU) is None
    assert cpu_kernels.sample(CPU, torch.float32) is None
    assert cpu_kernels.available_projections(CPU, torch.float32) == {}
    reference = _greedy(tiny_model_dir, PROMPTS)
    assert not any(r["packed"] or r["fused"] for r in reference), "the switch leaves torch's path"
    monkeypatch.delenv(cpu_kernels.CPU_KERNELS_ENV)
    accelerated = _greedy(tiny_model_dir, PROMPTS)
    if torch.backends.mkldnn.is_available():
        assert all(r["packed"] and r["fused"] for r in accelerated)
    for ref, acc in zip(reference, accelerated, strict=True):
        assert acc["ids"] == ref["ids"]
        torch.testing.assert_close(torch.tensor(acc["logprobs"]), torch.tensor(ref["logprobs"]),
                                   atol=2e-4, rtol=0)


def _step(model, decoder, prompts) -> torch.Tensor:
    """One decode step after prefilling ``prompts``: the next token's logits [rows, vocab]."""
    with torch.no_grad():
        layers_kv, mask, last = forest_prefill(model, prompts, CPU)
        slots = SlotCache(len(layers_kv), layers_kv[0][0].shape[1], layers_kv[0][0].shape[3],
                          layers_kv[0][0].dtype, CPU, keys_blocked=decoder.uses_kernels)
        slots.join(layers_kv, mask, torch.arange(len(prompts)))
        return decoder(last.argmax(-1), mask.sum(-1), slots.decode_mask(), slots).float(), last


def _torch_step(model_dir, dtype: torch.dtype, prompts) -> torch.Tensor:
    """The same step on torch's path: transformers' forward over prompt and token, unpacked."""
    lm = load_model(model_dir, str(dtype).removeprefix("torch.")).eval()
    lm.config._attn_implementation = ATTENTION
    with torch.no_grad():
        _, _, last = forest_prefill(lm, prompts, CPU)
        full = [p + [int(t)] for p, t in zip(prompts, last.argmax(-1), strict=True)]
        return forest_prefill(lm, full, CPU)[2].float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("isa", ["amx", "avx512", "avx2"])
def test_each_projection_kernel_this_machine_has_decodes_as_torch_does(isa, dtype, tiny_model_dir,
                                                                     monkeypatch):
    """The decode step on the ``isa`` projection kernel, at every batch (no timing), against
    torch's step: fp32 the same up to the order of the sums; bf16 no further from the fp32
    step than torch's own bf16 step is."""
    if not cpu_kernels.load():
        pytest.skip("no C++ toolchain to build the kernels with")
    monkeypatch.setenv(cpu_kernels.AVX512_LINEAR_ENV, "1")
    monkeypatch.setenv(cpu_kernels.AVX2_LINEAR_ENV, "1")
    kernel = cpu_kernels.available_projections(CPU, dtype).get(isa)
    if kernel is None:
        pytest.skip(f"this machine has no {isa} projection kernel for {dtype}")
    lm = load_model(tiny_model_dir, str(dtype).removeprefix("torch.")).eval()
    if pack_linears(lm) == 0 or not fused_decode.supports(lm):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU: the fused step does not run")
    lm.config._attn_implementation = ATTENTION
    monkeypatch.setattr(cpu_kernels, "projections", lambda device, dt: kernel)
    decoder = fused_decode.FusedDecoder(lm)
    assert decoder._proj is not None and decoder._proj.name == kernel.name
    calls = []
    real = decoder._proj.linear
    decoder._proj = dataclasses.replace(decoder._proj, linear=lambda *a: calls.append(a[3]) or real(*a))
    decoder._layers_op = None  # the layers' loop in Python, whose kernel calls are counted
    on_kernel, _ = _step(lm, decoder, PROMPTS)
    assert calls, f"the {isa} kernel did not run"
    reference = _torch_step(tiny_model_dir, torch.float32, PROMPTS)
    if dtype == torch.float32:
        torch.testing.assert_close(on_kernel, reference, atol=2e-3, rtol=1e-3)
        return
    torch_bf16 = _torch_step(tiny_model_dir, torch.bfloat16, PROMPTS)
    assert (on_kernel - reference).abs().mean() <= 1.25 * (torch_bf16 - reference).abs().mean() + 1e-4
    greedy = reference.argmax(-1)
    assert (on_kernel.argmax(-1) == greedy).float().mean() >= \
        (torch_bf16.argmax(-1) == greedy).float().mean() - 0.1
    assert all(isinstance(m, PackedLinear) for m in lm.model.layers[0].mlp.modules()
               if isinstance(m, torch.nn.Linear))


def test_the_key_block_is_one_number_on_both_sides_of_the_language_boundary():
    """slot_cache stores keys in blocks the C++ attention reads: the two constants must agree
    (C++ cannot import Python, so the source is read)."""
    import re
    from pathlib import Path

    from training_core.rollout_server.slot_cache import KEY_BLOCK

    source = (Path(cpu_kernels.__file__).parent / "kernels" / "decode_step.cpp").read_text()
    assert re.findall(r"constexpr int64_t BLOCK = (\d+);", source) == [str(KEY_BLOCK)]
