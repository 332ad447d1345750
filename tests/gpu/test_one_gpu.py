"""One GPU (issue 45): the trainer on CUDA in bf16 with the embedded server on the same GPU,
disk weight sync, a few asynchronous steps of SmolLM2 whose mismatch metrics stay in bounds; and
the chunked logprobs against the full logits on CUDA, with the memory they save. The same APIs
as the CPU tests (tests/training_core/test_train_e2e.py, test_mismatch_e2e.py,
test_trainer_memory.py); skipped without CUDA."""

from __future__ import annotations

import math
import secrets

import httpx
import pytest
import torch

from tests.gpu.gpus import needs_gpus, smollm2_dir
from training_core.config import load_spec
from training_core.metric_names import MISMATCH, TOKENS_PER_S, WEIGHT_SYNC_PAUSE_S
from training_core.metrics import read_metrics
from training_core.transport.server_auth import SERVER_KEY_ENV

pytestmark = needs_gpus(1)


def _batch(rows: int, length: int, prompt: int, seed: int):
    from training_core.api import PROMPT_VERSION, TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 49_000, (rows, length), generator=g)
    versions = torch.zeros(rows, length, dtype=torch.long)
    versions[:, :prompt] = PROMPT_VERSION
    mask = (versions != PROMPT_VERSION).float()
    adv = torch.randn(rows, 1, generator=g) * mask
    return TrainBatch(ids, torch.ones(rows, length, dtype=torch.long), mask,
                      -torch.rand(rows, length, generator=g) * mask, versions, adv)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_logprobs_match_the_full_logits_on_cuda(dtype):
    from training_core.models.loading import load_model
    from training_core.prefix_tree import prefix_tree_logprobs

    model = load_model(smollm2_dir()).cuda().train()
    b = _batch(4, 512, 64, seed=0)
    ids, attention = b.input_ids.cuda(), b.attention_mask.cuda()
    weights = (torch.randn(ids.shape, generator=torch.Generator().manual_seed(1)) * b.loss_mask).cuda()
    out, grads, peaks = [], [], []
    for chunk in (None, 256):  # 256: eight chunks of the 1792 generated tokens
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            logp = prefix_tree_logprobs(model, ids, attention, b.versions, 1.0,
                                        chunk_tokens=chunk)
        (logp * weights).sum().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        out.append(logp.detach())
        grads.append(model.lm_head.weight.grad.detach().clone())
    generated = b.loss_mask.bool().cuda()
    # fp32: the same dot products (TF32 is off for matmuls by default); bf16: each chunk's
    # product may take another kernel, so the bf16 logits differ by their rounding.
    atol = 1e-5 if dtype == "float32" else 0.1
    torch.testing.assert_close(out[1][generated], out[0][generated], atol=atol, rtol=0)
    if dtype == "bfloat16":
        assert float((out[1] - out[0])[generated].abs().mean()) < 0.01
    if dtype == "float32":
        torch.testing.assert_close(grads[1], grads[0], atol=1e-3, rtol=1e-2)
    else:  # each chunk's weight gradient is rounded to bf16 before they are summed
        error = float((grads[1] - grads[0]).norm() / grads[0].norm())
        assert error < 2e-2, error
    # The full path holds 1792 x 49152 fp32 logits (352 MB) and its softmax across the
    # backward; a chunk is 256 rows.
    assert peaks[1] < peaks[0] - 300 * 2**20, peaks


@pytest.mark.slow
def test_bf16_trainer_and_embedded_server_share_the_gpu_through_async_steps(tmp_path):
    from training_core import processes
    from training_core.train import train

    smollm2_dir()  # skips, saying how to bring it, where SmolLM2 is missing
    run_dir = tmp_path / "run"
    spec = load_spec(None, [
        "model.path=smollm2", "model.dtype=bfloat16", f"run_dir={run_dir}",
        "weight_sync=disk", "rollout.backend=embedded", "trainer.steps=4",
        "rollout.max_staleness=1", "rollout.max_token_staleness=1", "rollout.max_concurrent=16",
        "rollout.group_size=4", "trainer.batch_groups=2", "rollout.max_new_tokens=24",
        "data.chat_template=true", "data.prompt_template='What is {question}?'",
        "data.options={max_value: 9}", "trainer.lr=1e-6", "eval.every=0", "checkpoint.every=0",
        "reward.fn=builtin:numeric", "reward.executor=inline"])
    infos: list[tuple[dict, dict]] = []
    real_stop = processes.Fleet.stop
    key = secrets.token_hex(32)  # the run's server key (else one the test could not know)
    auth = {"Authorization": f"Bearer {key}"}

    def stop_after_asking(fleet):  # the servers' own word, just before the run stops them
        for url in fleet.urls:
            infos.append((httpx.get(url + "/server_info", headers=auth, timeout=30).json(),
                          httpx.get(url + "/model_info", headers=auth, timeout=30).json()))
        real_stop(fleet)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SERVER_KEY_ENV, key)
        mp.setattr(processes.Fleet, "stop", stop_after_asking)
        result = train(spec, progress=False)
    assert torch.cuda.max_memory_allocated() > 0, "the trainer ran on the GPU"
    assert len(infos) == 1, "one embedded server, started by the run"
    server, model_info = infos[0]
    # The run's server on the GPU the trainer uses (one GPU: start_fleet shares it).
    assert server["device"].startswith("cuda") and server["dtype"] == "bfloat16", server
    assert model_info["weight_version"] == "4"
    assert list((run_dir / "weights").glob("*/model.safetensors")), "disk sync wrote weights"

    rows = [r for r in read_metrics(result.run_dir) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    assert all(r["staleness/max"] <= 1 for r in rows)
    for r in rows:
        assert all(math.isfinite(r[k]) for k in MISMATCH.ALL), r
        # The server samples with bf16 weights, the trainer computes under bf16 autocast from
        # fp32 masters: close, not equal. On CPU this pair reads k3 up to ~0.1 on SmolLM2 at
        # T = 1 (benchmarks/gpu_check.py's task, 2026-11-28); a server on other weights or in
        # another dtype reads k3 of order 1 and an ESS far below 1. No GPU has run this yet:
        # bounds with room, to be tightened from the first GPU run (docs/gpu-check.md).
        assert 0 <= r[MISMATCH.kl_k3] < 0.2, r
        assert r[MISMATCH.ess] > 0.5, r
        assert 0.5 < r[MISMATCH.weight_mean] < 2.0, r
        assert r[TOKENS_PER_S] > 0 and r[WEIGHT_SYNC_PAUSE_S] >= 0
