"""Where the embedded engine's time goes on SmolLM2-135M: one request of ``--batch`` chat prompts
(rollout_engine.py's) answered in this process by ``GenerationEngine``, its fused decoder's decode
steps and prefills timed by wrapping them, then the projections of one step timed alone.

    python benchmarks/engine_step.py [--quick] --out bench-results/engine_step.json

No HTTP and no second model in the process, so the figures are the engine's own; the server's
throughput is rollout_engine.py's. Per precision: tokens/s over the request's wall time, the
median decode step, the prefill's seconds, and the shares that say where the next lever is: the
decode steps' share of the request and the projections' share of a step (every layer's q/k/v, o,
MLP and lm_head at the batch's rows, each weight read from memory as in a step, best of
``--rounds`` x 4; the projections run through the Python loop there, not the step's one C++
call, so a share near or above 1 means the rest of the step is small). Writes
{"runs": [{"precision", "batch", "tok_s", "step_ms", "prefill_s", "steps_share",
"projections_ms", "projections_share", "projections", "rounds": [...]}], "machine", "config"}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from rollout_engine import cpu_identity, prompts  # noqa: E402

PRECISIONS = ("float32", "bfloat16")
MARK = "engine_step: "  # the line of a child's stdout that holds its figures


@contextmanager
def timed_decoder(times: dict[str, list[float]]):
    """FusedDecoder's step (``__call__``) and ``prefill`` timed into ``times["step"]`` and
    ``times["prefill"]`` while inside; the class is restored after."""
    from training_core.rollout_server.fused_decode import FusedDecoder

    originals = {"step": FusedDecoder.__call__, "prefill": FusedDecoder.prefill}

    def wrap(key: str):
        original = originals[key]

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = original(*args, **kwargs)
            times[key].append(time.perf_counter() - start)
            return out
        return timed

    FusedDecoder.__call__, FusedDecoder.prefill = wrap("step"), wrap("prefill")
    try:
        yield
    finally:
        FusedDecoder.__call__, FusedDecoder.prefill = originals["step"], originals["prefill"]


def answer(engine, rows: list[list[int]], new_tokens: int) -> float:
    """One request of ``rows``, every answer ``new_tokens`` long; its wall seconds."""
    from training_core.rollout_server.generation_engine import Seq

    async def main() -> None:
        loop = asyncio.get_running_loop()
        futures = []
        for i, row in enumerate(rows):
            future = loop.create_future()
            engine.submit(Seq(f"r{i}", list(row), new_tokens, 1.0, 1.0, 0, set(), True, future,
                              loop))
            futures.append(future)
        await asyncio.gather(*futures)

    start = time.perf_counter()
    asyncio.run(main())
    return time.perf_counter() - start


def projections_ms(decoder, rows: int, repeats: int) -> float:
    """The projections of one decode step at ``rows`` rows with the kernel the step uses (None:
    oneDNN's), best of ``repeats``, after two untimed."""
    kernel = decoder._proj.linear if decoder._proj is not None else None
    best = float("inf")
    with torch.inference_mode():
        for i in range(repeats + 2):
            start = time.perf_counter()
            decoder._projections(rows, kernel)
            if i >= 2:
                best = min(best, time.perf_counter() - start)
    return best * 1e3


def measure(precision: str, batch: int, new_tokens: int, rounds: int) -> dict:
    from training_core.models.paths import resolve_model_dir
    from training_core.rollout_server.generation_engine import GenerationEngine

    engine = GenerationEngine(str(resolve_model_dir("smollm2")), seed=1, dtype=precision)
    try:
        rows = prompts(engine.tokenizer, batch)
        answer(engine, rows[:4], 4)  # warm-up: first prefill, buffers
        measured = []
        for _ in range(rounds):
            times: dict[str, list[float]] = {"step": [], "prefill": []}
            with timed_decoder(times):
                wall = answer(engine, rows, new_tokens)
            measured.append({"wall_s": wall, "steps": len(times["step"]),
                             "step_s": sorted(times["step"]), "prefill_s": sum(times["prefill"])})
        decoder = engine._fused  # the engine's own decoder (None where the model is not fused)
        proj = projections_ms(decoder, batch, 4 * rounds) if decoder is not None else None
        described = (decoder._proj.describe() if decoder is not None and decoder._proj is not None
                     else "oneDNN's")
    finally:
        engine.shutdown()
    return {"rounds": measured, "projections_ms": proj, "projections": described}


def measure_apart(precision: str, batch: int, new_tokens: int, rounds: int, threads: int) -> dict:
    """``measure`` in a process of its own: in one process a bf16 engine after an fp32 one ran
    its steps 35% slower (74 against 54 ms on a Zen 4 EPYC), as a server never does."""
    out = subprocess.run([sys.executable, __file__, "--measure-one", precision, "--batch",
                          str(batch), "--new-tokens", str(new_tokens), "--rounds", str(rounds),
                          "--threads", str(threads)], capture_output=True, text=True, check=True)
    return json.loads(next(line for line in out.stdout.splitlines()
                           if line.startswith(MARK))[len(MARK):])


def report(measured: dict[str, dict], config: dict, machine: dict) -> dict:
    """The JSON from ``measured[precision]`` (``measure``'s): medians over the rounds."""
    runs = []
    for precision, m in measured.items():
        rounds = [{"tok_s": config["batch"] * config["new_tokens"] / r["wall_s"],
                   "wall_s": r["wall_s"], "steps": r["steps"],
                   "step_ms": statistics.median(r["step_s"]) * 1e3 if r["step_s"] else None,
                   "steps_s": sum(r["step_s"]), "prefill_s": r["prefill_s"]}
                  for r in m["rounds"]]
        step_ms = statistics.median(r["step_ms"] for r in rounds) if all(
            r["step_ms"] is not None for r in rounds) else None
        runs.append({
            "precision": precision, "batch": config["batch"],
            "tok_s": statistics.median(r["tok_s"] for r in rounds),
            "step_ms": step_ms,
            "prefill_s": statistics.median(r["prefill_s"] for r in rounds),
            "steps_share": statistics.median(r["steps_s"] / r["wall_s"] for r in rounds),
            "projections_ms": m["projections_ms"],
            "projections_share": (m["projections_ms"] / step_ms
                                  if m["projections_ms"] is not None and step_ms else None),
            "projections": m["projections"], "rounds": rounds})
    return {"runs": runs, "machine": machine, "config": config}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 new tokens, one round (< 2 min)")
    parser.add_argument("--out", default="bench-results/engine_step.json")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--measure-one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    new_tokens = args.new_tokens or (32 if args.quick else 128)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    if args.measure_one:  # a child of the run below: one precision, its figures to stdout
        print(MARK + json.dumps(measure(args.measure_one, args.batch, new_tokens, rounds)))
        return 0
    measured = {p: measure_apart(p, args.batch, new_tokens, rounds, args.threads)
                for p in args.precisions.split(",")}
    machine = {"cpus": os.cpu_count(), "threads": args.threads, **cpu_identity(),
               "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}
    config = {"model": "smollm2", "batch": args.batch, "new_tokens": new_tokens, "rounds": rounds,
              "quick": args.quick, "wall_s": time.perf_counter() - started}
    result = report(measured, config, machine)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for run in result["runs"]:
        step = f"{run['step_ms']:.1f} ms" if run["step_ms"] is not None else "not fused"
        proj = (f", projections {run['projections_ms']:.1f} ms ({run['projections']})"
                if run["projections_ms"] is not None else "")
        print(f"{run['precision']:>8} batch {run['batch']}: {run['tok_s']:.0f} tok/s, a step "
              f"{step}, prefill {run['prefill_s']:.2f} s, steps {run['steps_share']:.0%} of the "
              f"request{proj}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
