"""Peak memory of one SmolLM2-135M training step on 4k tokens: the full [T, V] fp32 logits (the
trainer before issue 45) against logprobs from the hidden states in chunks, each with and without
activation checkpointing. Measured on CPU, each configuration in a process of its own.

    python benchmarks/trainer_memory.py [--quick] --out bench-results/trainer_memory.json

Per configuration a fresh process loads the trainer (fp32, ZeRO 0, the run's defaults: shared
prefixes, one micro-batch), takes one step on a two-row batch so Adam's states exist, resets the
kernel's resident high-water mark (``/proc/self/clear_refs``), takes the measured step (8 prompts
x 512 tokens, 448 of them generated: 4096 tokens through the loss) and reads the high-water mark
(``VmHWM``) again. ``peak_step_bytes`` is that mark less the resident size just before the step:
what the step itself needed on top of the weights and optimizer states. torch's CPU allocations
are glibc's (large ones straight from ``mmap``), so the resident size is what they take; the
trainer's own allocator setting (``allocator.retain_freed_memory``) is left off here so freed
blocks go back. Writes {"configs": {"plain": {"peak_step_bytes", "step_s", ...}, "chunked": ...,
"plain_checkpointing": ..., "chunked_checkpointing": ...}, "ratios": {name: peak / plain's}}.
``--quick``: 1024 tokens (8 x 128).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (logit chunk tokens, activation checkpointing); None: the full logits
CONFIGS = {"plain": (None, False), "chunked": (1024, False),
           "plain_checkpointing": (None, True), "chunked_checkpointing": (1024, True)}
BASELINE = "plain"


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _batch(rows: int, length: int, prompt: int, seed: int, vocab: int):
    import torch

    from training_core.api import PROMPT_VERSION, TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, min(49_000, vocab), (rows, length), generator=g)
    versions = torch.zeros(rows, length, dtype=torch.long)
    versions[:, :prompt] = PROMPT_VERSION
    mask = (versions != PROMPT_VERSION).float()
    adv = torch.randn(rows, 1, generator=g) * mask
    behav = -torch.rand(rows, length, generator=g) * mask
    return TrainBatch(ids, torch.ones(rows, length, dtype=torch.long), mask, behav, versions, adv)


def measure(name: str, row_tokens: int, model: str = "smollm2") -> dict:
    """One configuration, in this process (``--one``; the high-water mark is the process's)."""
    import torch

    from training_core.algorithms.loss import decoupled_ppo_loss
    from training_core.algorithms.presets import PRESETS
    from training_core.models.paths import resolve_model_dir
    from training_core.trainer.deepspeed_trainer import DeepSpeedTrainer

    chunk, checkpointing = CONFIGS[name]
    torch.manual_seed(0)
    trainer = DeepSpeedTrainer(resolve_model_dir(model), lr=1e-6, weight_decay=0.0,
                               grad_clip=1.0, zero_stage=0, micro_batch_tokens=8 * row_tokens,
                               activation_checkpointing=checkpointing, logit_chunk_tokens=chunk)
    loss_fn = lambda *a, **k: decoupled_ppo_loss(*a, cfg=PRESETS["grpo"], **k)  # noqa: E731
    vocab = trainer.engine.module.config.vocab_size
    # A small first step: Adam's states exist from here, as in every step after a run's first.
    trainer.train_step(_batch(2, 16, 4, seed=1, vocab=vocab), None, loss_fn)
    batch = _batch(8, row_tokens, min(64, row_tokens // 2), seed=2, vocab=vocab)
    before_kb = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from here
    start = time.perf_counter()
    stats = trainer.train_step(batch, None, loss_fn)
    step_s = time.perf_counter() - start
    peak_kb = _status_kb("VmHWM")
    return {"peak_step_bytes": (peak_kb - before_kb) * 1024, "peak_rss_bytes": peak_kb * 1024,
            "rss_before_bytes": before_kb * 1024, "step_s": step_s,
            "tokens": int(batch.loss_mask.sum()), "loss": stats["loss"],
            "grad_norm": stats["grad_norm"], "logit_chunk_tokens": chunk,
            "activation_checkpointing": checkpointing}


def report(configs: dict[str, dict], **about) -> dict:
    """The JSON: each configuration's figures and its step peak against the baseline's."""
    base = configs[BASELINE]["peak_step_bytes"]
    return {**about, "configs": configs,
            "ratios": {n: r["peak_step_bytes"] / base for n, r in configs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1024 tokens instead of 4096")
    parser.add_argument("--out", default="bench-results/trainer_memory.json")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--one", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--row-tokens", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    row_tokens = args.row_tokens or (128 if args.quick else 512)
    if args.one:  # the child: one configuration, its result on stdout's last line
        print(json.dumps(measure(args.one, row_tokens)))
        return
    names = args.configs.split(",")
    if BASELINE not in names:
        names.insert(0, BASELINE)
    configs: dict[str, dict] = {}
    for name in names:
        run = subprocess.run([sys.executable, __file__, "--one", name, "--row-tokens",
                              str(row_tokens)], cwd=ROOT, capture_output=True, text=True,
                             timeout=3600)
        if run.returncode != 0:
            raise SystemExit(f"{name} failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
        r = json.loads(run.stdout.strip().splitlines()[-1])
        configs[name] = r
        print(f"{name:22s} step peak {r['peak_step_bytes'] / 2**20:8.0f} MiB  "
              f"(resident {r['peak_rss_bytes'] / 2**20:.0f} MiB)  step {r['step_s']:.1f} s  "
              f"loss {r['loss']:.6f}", flush=True)
    result = report(configs, model="smollm2", tokens=8 * row_tokens, rows=8,
                    threads=int(os.environ["OMP_NUM_THREADS"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
