"""Supervised warm start on the task's own rows (``oolong sft``).

RL from random weights gets no reward signal, so the demo first teaches the tiny model the
answer format for a short while, leaving room for RL to improve accuracy.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from training_core.config import RunSpec
from training_core.data.datasets import named_eval_sets, warm_start_rows
from training_core.models.loading import load_model, load_tokenizer
from training_core.models.paths import spec_model_dir
from training_core.optim import adamw
from training_core.workflows.base import WorkflowContext


def sft(spec: RunSpec, out_dir: str | Path, *, steps: int = 300, seconds: float | None = None,
        batch_size: int = 64, lr: float = 3e-3, progress: bool = True) -> Path:
    torch.manual_seed(spec.seed)
    torch.set_num_threads(spec.trainer.threads)
    model_dir = spec_model_dir(spec)
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir).train()
    rows = warm_start_rows(spec.data, spec.seed,  # never the RL run's eval questions
                           named=named_eval_sets(spec.eval.sets, spec.eval.size))
    ctx = WorkflowContext(tokenizer=tok, rewards=None, sampling=None, group_size=1,  # type: ignore[arg-type]
                          prompt_template=spec.data.prompt_template,
                          chat_template=spec.data.chat_template)
    examples = []
    for row in rows:
        prompt = ctx.render_prompt(row)
        target = tok.encode(str(row.get("solution", row["answer"])), add_special_tokens=False)
        examples.append((prompt, target + [tok.eos_token_id]))
    opt = adamw(model.parameters(), lr=lr)
    rng = random.Random(spec.seed)
    start = time.perf_counter()
    bar = tqdm(total=steps, desc="sft warm start", disable=not progress, dynamic_ncols=True)
    for _ in range(steps):
        if seconds is not None and time.perf_counter() - start > seconds:
            break
        batch = rng.sample(examples, min(batch_size, len(examples)))
        width = max(len(p) + len(t) for p, t in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        attn = torch.zeros_like(ids)
        for i, (p, t) in enumerate(batch):
            seq = p + t
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(p): len(seq)] = torch.tensor(t)
            attn[i, : len(seq)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
