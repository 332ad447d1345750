"""The embedded rollout server against HF ``generate`` on SmolLM2-135M: same model folder,
precision, batch, threads and prompts, logprobs on for both, every answer ``--new-tokens`` long.

    python benchmarks/rollout_engine.py [--quick] --out bench-results/rollout_engine.json

Per precision (float32, bfloat16) and batch (16, 64): the server (``--threads`` torch threads,
``--dtype``) answers one /generate of ``batch`` prompts; HF ``generate`` runs in this process on
as many threads (sampling at temperature 1 without top-k/top-p, ``compute_transition_scores``
for the logprobs). Rounds alternate the two; medians are reported. Throughput is generated
tokens over wall time, prefill included on both sides.

The machine's bound, measured in the same run before the server starts: compute (a decode-shaped matmul,
[batch, hidden] x [hidden, intermediate], at this precision and thread count, torch's or the
engine's projection kernel's, whichever is faster, against 2 FLOPs
per parameter per token) and memory (every weight read once per decode step, and each row's
KV cache at the mean context, prompt plus half the answer, at the bandwidth of a large copy). ``bound_tok_s`` is the lower of the two; the engine's share of it is what is
left to win. Writes {"runs": [{"precision", "batches": {"16": {"embedded_tok_s", "hf_tok_s",
"ratio", "bound_tok_s", ...}, "64": {...}}}, ...], "machine": {...}, "config": {...}}.
Aims (issue 26): bfloat16 batch 64 >= 2,000 tok/s, and >= 2x HF at each precision.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

AIM_TOK_S = 2000.0  # bfloat16, batch 64
AIM_RATIO = 2.0
PRECISIONS = ("float32", "bfloat16")
BATCHES = (16, 64)


def prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` distinct chat prompts (a sum each), as a reasoning-gym task would send."""
    out = []
    for i in range(n):
        text = f"What is {17 + 7 * i} + {5 + 13 * i}? Answer with the number."
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
    return out


# ---- the two sides ------------------------------------------------------------------------------


async def _embedded(url: str, rows: list[list[int]], new_tokens: int) -> float:
    import httpx

    body = {"input_ids": rows, "return_logprob": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0, "top_p": 1.0,
                                "top_k": -1, "ignore_eos": True}}
    async with httpx.AsyncClient(timeout=1800) as client:
        start = time.perf_counter()
        resp = await client.post(url + "/generate", json=body)
        wall = time.perf_counter() - start
    resp.raise_for_status()
    out = resp.json()
    assert all(len(o["meta_info"]["output_token_logprobs"]) == new_tokens for o in out)
    return len(rows) * new_tokens / wall


def embedded_tok_s(url: str, rows: list[list[int]], new_tokens: int) -> float:
    return asyncio.run(_embedded(url, rows, new_tokens))


def hf_tok_s(model, tokenizer, rows: list[list[int]], new_tokens: int) -> float:
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=pad)
        logprobs = model.compute_transition_scores(out.sequences, out.scores,
                                                   normalize_logits=True)
    wall = time.perf_counter() - start
    assert logprobs.shape == (len(rows), new_tokens)
    return len(rows) * new_tokens / wall


# ---- the machine's bound ------------------------------------------------------------------------


def matmul_gflops(batch: int, hidden: int, inner: int, dtype: torch.dtype,
                  repeats: int = 20) -> float:
    """The faster of torch's matmul and the engine's own projection kernel (cpu_kernels, where
    one serves this CPU and dtype) at the decode shape: on an AVX-512 CPU without AMX the
    engine's bf16 kernel outruns torch's, and a bound below what the engine runs is none."""
    from training_core.rollout_server import cpu_kernels

    a = torch.randn(batch, hidden, dtype=dtype)
    w = torch.randn(inner, hidden, dtype=dtype)
    candidates = [lambda: a @ w.t()]
    kernel = cpu_kernels.projections(torch.device("cpu"), dtype)
    if kernel is not None and inner % 32 == 0 and hidden % 32 == 0:
        packed = kernel.pack(w)
        candidates.append(lambda: kernel.linear(a, packed, None, "none"))
    best = 0.0
    for run in candidates:
        for _ in range(3):
            run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        best = max(best, 2 * batch * hidden * inner / statistics.median(times) / 1e9)
    return best


def copy_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times) / 1e9  # read + write


def kv_bytes_per_row(cfg, dtype: torch.dtype, context: float) -> float:
    """The KV cache one row's decode step reads at ``context`` positions: keys and values of
    every layer (at 64 rows and ~100 positions, about half the weights' bytes for SmolLM2)."""
    from training_core.rollout_server.fused_decode import head_dim

    per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim(cfg)
    return context * per_position * torch.finfo(dtype).bits / 8


def bound(params: int, hidden: int, inner: int, batch: int, dtype: torch.dtype,
          kv_row_bytes: float = 0.0) -> dict:
    """Compute: 2 FLOPs per parameter per token at the measured matmul rate. Memory: a step
    reads every weight once and each row's KV cache (``kv_row_bytes``), at the copy's rate."""
    gflops = matmul_gflops(batch, hidden, inner, dtype)
    gbps = copy_gbps()
    compute = gflops * 1e9 / (2 * params)
    weight_bytes = params * torch.finfo(dtype).bits / 8
    memory = batch * gbps * 1e9 / (weight_bytes + batch * kv_row_bytes)
    return {"matmul_gflops": gflops, "copy_gbps": gbps, "compute_bound_tok_s": compute,
            "memory_bound_tok_s": memory, "bound_tok_s": min(compute, memory),
            "step_mb": {"weights": weight_bytes / 1e6, "kv_cache": batch * kv_row_bytes / 1e6}}


# ---- the report ---------------------------------------------------------------------------------


def server_projections(log_dir: Path) -> str | None:
    """What the server's decode step multiplies with, from its log (fused_decode logs it once
    its choice is measured): e.g. "avx512-pairs at 1-3, 4-15 rows" or "oneDNN's"."""
    found = None
    for path in sorted(log_dir.glob("rollout-server-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if "decode projections: " in line:
                found = line.split("decode projections: ", 1)[1].strip()
    return found


def report(measured: dict[str, dict[int, dict]], config: dict, machine: dict,
           projections: dict[str, str | None] | None = None) -> dict:
    """The JSON from the rounds measured: ``measured[precision][batch]`` holds the lists
    ``embedded`` and ``hf`` (tok/s per round) and the bound's figures. Medians, their ratio, and
    whether the aims are met; per precision, the server's projections (``server_projections``)."""
    runs = []
    for precision, batches in measured.items():
        out = {}
        for batch, m in batches.items():
            emb, hf = statistics.median(m["embedded"]), statistics.median(m["hf"])
            out[str(batch)] = {
                "embedded_tok_s": emb, "hf_tok_s": hf, "ratio": emb / hf,
                "bound_tok_s": m["bound_tok_s"], "share_of_bound": emb / m["bound_tok_s"],
                "compute_bound_tok_s": m["compute_bound_tok_s"],
                "memory_bound_tok_s": m["memory_bound_tok_s"], "matmul_gflops": m["matmul_gflops"],
                "step_mb": m.get("step_mb"),
                "embedded_rounds": m["embedded"], "hf_rounds": m["hf"]}
        runs.append({"precision": precision, "batches": out,
                     "projections": (projections or {}).get(precision)})
    by = {r["precision"]: r["batches"] for r in runs}
    aims = {"ratio_ge_2": {p: all(b["ratio"] >= AIM_RATIO for b in bs.values())
                           for p, bs in by.items()}}
    if "bfloat16" in by and "64" in by["bfloat16"]:
        aims["bf16_batch64_ge_2000_tok_s"] = by["bfloat16"]["64"]["embedded_tok_s"] >= AIM_TOK_S
    return {"runs": runs, "aims": aims, "machine": machine, "config": config}


def cpu_identity() -> dict:
    """The CPU's model and its bf16 instructions: the aim of 2,000 tok/s was set on a CPU with
    AMX (a bf16 matmul ~7x fp32); with AVX512-BF16 alone it is ~2x, and the bound says so."""
    from training_core.rollout_server.cpu_kernels import cpu_fields, cpu_info

    model, flags = cpu_info()
    fields = cpu_fields()
    # a VM may name every EPYC "AMD EPYC"; AMD's 25/1 is Zen 3, 25/17 Zen 4, 26/x Zen 5, and their
    # bf16 rates differ by 2x or more
    family = (f"{fields['cpu family']}/{fields['model']}"
              if "cpu family" in fields and "model" in fields else None)
    return {"cpu_model": model, "cpu_family_model": family,
            "bf16_instructions": sorted(f for f in flags if f in ("amx_bf16", "avx512_bf16"))}


# ---- main ---------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 new tokens, one round (< 5 min)")
    parser.add_argument("--out", default="bench-results/rollout_engine.json")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--logs", default=None, help="keep the server's log here")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    new_tokens = args.new_tokens or (32 if args.quick else 128)
    precisions = args.precisions.split(",")
    batches = [int(b) for b in args.batches.split(",")]

    from training_core.launch import start_embedded_fleet
    from training_core.models.loading import load_model, load_tokenizer
    from training_core.models.paths import resolve_model_dir

    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir("smollm2")
    tokenizer = load_tokenizer(model_dir)
    rows = prompts(tokenizer, max(batches))
    measured: dict[str, dict[int, dict]] = {}
    projections: dict[str, str | None] = {}
    started = time.perf_counter()
    for precision in precisions:
        dtype = getattr(torch, precision)
        model = load_model(model_dir, precision).eval()
        cfg = model.config
        params = sum(p.numel() for p in model.parameters())  # a tied lm_head counted once
        # The bound before the server starts: measured beside it, right after a request, its
        # threads still held the cores (an AVX2 EPYC measured 72 GFLOPS there, 144 alone, and
        # reported the engine at 89% of a bound it was at half of).
        bounds = {}
        for batch in batches:
            # the mean context a decode step reads: the prompt and half the answer
            context = statistics.mean(map(len, rows[:batch])) + new_tokens / 2
            bounds[batch] = bound(params, cfg.hidden_size, cfg.intermediate_size, batch, dtype,
                                  kv_bytes_per_row(cfg, dtype, context))
        with tempfile.TemporaryDirectory() as logs:
            fleet = start_embedded_fleet(str(model_dir), 1, args.logs or logs, threads=args.threads,
                                         max_batch_size=max(batches), dtype=precision)
            try:
                url = fleet.urls[0]
                embedded_tok_s(url, rows[:4], 4)  # warm-up: first prefill, buffers
                hf_tok_s(model, tokenizer, rows[:4], 4)
                projections[precision] = server_projections(Path(args.logs or logs))
                measured[precision] = {}
                for batch in batches:
                    m = {"embedded": [], "hf": [], **bounds[batch]}
                    for r in range(rounds):  # alternate which side goes first
                        for side in (("embedded", "hf") if r % 2 == 0 else ("hf", "embedded")):
                            m[side].append(
                                embedded_tok_s(url, rows[:batch], new_tokens) if side == "embedded"
                                else hf_tok_s(model, tokenizer, rows[:batch], new_tokens))
                    measured[precision][batch] = m
                    print(f"{precision} batch {batch}: embedded {m['embedded']} hf {m['hf']} "
                          f"bound {m['bound_tok_s']:.0f} tok/s", flush=True)
            finally:
                fleet.stop()
        del model
    machine = {"cpus": os.cpu_count(), "threads": args.threads, **cpu_identity(),
               "cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "load_average_1m": os.getloadavg()[0], "torch": torch.__version__}
    config = {"model": "smollm2", "new_tokens": new_tokens, "rounds": rounds, "quick": args.quick,
              "batches": batches, "precisions": precisions,
              "wall_s": time.perf_counter() - started}
    result = report(measured, config, machine, projections)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for run in result["runs"]:
        for batch, b in run["batches"].items():
            print(f"{run['precision']:>8} batch {batch:>3}: embedded {b['embedded_tok_s']:7.0f} "
                  f"HF {b['hf_tok_s']:7.0f} tok/s ratio {b['ratio']:.2f}, bound "
                  f"{b['bound_tok_s']:.0f} ({b['share_of_bound']:.0%} of it)")
    print(json.dumps(result["aims"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
