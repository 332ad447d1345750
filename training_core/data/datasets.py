"""Load a dataset from the spec's ``data.source`` into a list of rows.

Every row ends up with ``question`` and ``answer`` (names mapped from the spec's fields), plus
whatever else the source had. Errors name the file, the line and the fix.
"""

from __future__ import annotations

import csv
import json
import random
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training_core.data.synthetic import arithmetic_items

GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.S)


class DatasetError(ValueError):
    pass


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{lineno}: each line must be a JSON object")
            rows.append(row)
    return rows


def read_csv(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8", newline="") as fh:
        return list(csv.DictReader(fh))


def read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def read_hf_disk(path: Path) -> list[dict[str, Any]]:
    from datasets import DatasetDict, load_from_disk

    ds = load_from_disk(str(path))
    if isinstance(ds, DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    return ds.to_list()


def gsm8k_final_answer(answer: str) -> str:
    """GSM8K answers end with ``#### N``; return N without thousands separators."""
    match = GSM8K_ANSWER.search(answer)
    if not match:
        raise DatasetError("GSM8K answer has no '#### <number>' line")
    return match.group(1).replace(",", "").strip()


def reasoning_gym_rows(name: str, size: int, seed: int, options: dict[str, Any]) -> list[dict[str, Any]]:
    import reasoning_gym

    ds = reasoning_gym.create_dataset(name, size=size, seed=seed, **options)
    rows = []
    for entry in ds:
        rows.append({
            "question": entry["question"],
            "answer": str(entry["answer"]),
            # Everything the scorer needs travels with the row (rewards run in other processes).
            "rg_entry": json.loads(json.dumps(entry, default=str)),
            "rg_dataset": name,
        })
    return rows


@dataclass
class LoadedData:
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]


def _normalise(rows: list[dict[str, Any]], qf: str, af: str, origin: str) -> list[dict[str, Any]]:
    out = []
    for i, row in enumerate(rows):
        missing = [f for f in (qf, af) if f not in row]
        if missing:
            raise DatasetError(
                f"{origin}: row {i + 1} lacks field(s) {missing}; set data.question_field / "
                f"data.answer_field to the names it uses (it has {sorted(row)})"
            )
        out.append({**row, "question": str(row[qf]), "answer": str(row[af])})
    return out


def load_rows(source: str, *, options: dict[str, Any], size: int, seed: int,
              question_field: str = "question", answer_field: str = "answer") -> list[dict[str, Any]]:
    kind, _, arg = source.partition(":")
    if kind == "synthetic":
        if arg != "arithmetic":
            raise DatasetError(f"data.source synthetic:{arg} is unknown; use synthetic:arithmetic")
        return arithmetic_items(size, seed, **options)
    if kind == "reasoning_gym":
        return reasoning_gym_rows(arg, size, seed, options)
    path = Path(arg)
    if not path.exists():
        raise DatasetError(f"data.source {source!r}: {path} does not exist")
    if kind == "gsm8k":
        rows = read_jsonl(path) if path.suffix == ".jsonl" else read_parquet(path)
        out = []
        for i, row in enumerate(_normalise(rows, "question", "answer", str(path))):
            try:
                final = gsm8k_final_answer(row["answer"])
            except DatasetError as exc:
                raise DatasetError(f"{path}: row {i + 1}: {exc}") from None
            out.append({**row, "answer": final, "solution": row["answer"]})
        return out
    readers = {"jsonl": read_jsonl, "parquet": read_parquet, "csv": read_csv, "hf_disk": read_hf_disk}
    if kind not in readers:
        raise DatasetError(f"data.source kind {kind!r} is unknown")
    return _normalise(readers[kind](path), question_field, answer_field, str(path))


def load_data(spec_data: Any, seed: int) -> LoadedData:
    """Split rows into train and a held-out eval set (generators draw eval with another seed)."""
    kind = spec_data.source.split(":", 1)[0]
    common = dict(options=spec_data.options, question_field=spec_data.question_field,
                  answer_field=spec_data.answer_field)
    if kind in ("synthetic", "reasoning_gym"):
        train = load_rows(spec_data.source, size=spec_data.size, seed=seed, **common)
        evals = load_rows(spec_data.source, size=max(spec_data.eval_size, 1), seed=seed + 10_007,
                          **common)[: spec_data.eval_size]
        return LoadedData(train, evals)
    rows = load_rows(spec_data.source, size=spec_data.size, seed=seed, **common)
    if not rows:
        raise DatasetError(f"data.source {spec_data.source!r} has no rows")
    rng = random.Random(seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    n_eval = min(spec_data.eval_size, len(rows) // 5)
    return LoadedData([rows[i] for i in order[n_eval:]], [rows[i] for i in order[:n_eval]])


class PromptLoader:
    """Endless, seeded, resumable iteration over training rows.

    Index ``i`` of the stream always maps to the same row (epoch ``i // len(rows)``, shuffled by
    the seed), so a checkpoint needs only the position and the indices handed out but not yet
    trained on; :meth:`restore` hands those out again before continuing.
    """

    def __init__(self, rows: list[dict[str, Any]], seed: int):
        if not rows:
            raise DatasetError("no training rows")
        self.rows = rows
        self.seed = seed
        self.position = 0  # stream indices handed out since the start
        self._requeued: deque[int] = deque()
        self._epoch = -1
        self._order: list[int] = []

    def restore(self, position: int, pending: list[int] | None = None) -> None:
        bad = [i for i in pending or [] if not 0 <= i < position]
        if bad:
            raise DatasetError(f"checkpointed prompt indices {bad[:5]} lie outside 0..{position - 1}")
        self.position = position
        self._requeued = deque(sorted(pending or []))

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            order = list(range(len(self.rows)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch, self._order = epoch, order
        return self._order

    def row(self, index: int) -> dict[str, Any]:
        epoch, idx = divmod(index, len(self.rows))
        return self.rows[self._order_for(epoch)[idx]]

    def next(self) -> tuple[int, dict[str, Any]]:
        if self._requeued:
            index = self._requeued.popleft()
        else:
            index = self.position
            self.position += 1
        return index, self.row(index)
