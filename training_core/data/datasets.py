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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training_core.data.synthetic import arithmetic_items
from training_core.metric_names import DEFAULT_EVAL_SET

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


# Generators draw the eval set from seed ``seed + EVAL_SEED_OFFSET``. reasoning-gym seeds item i
# with Random(seed + i), so an offset within reach of data.size made eval row j training row
# offset + j (the old offset, 10_007, did for every run with the default 100,000 rows). Training
# uses seeds seed .. seed + size - 1; the offset is far above any size a spec may ask for
# (MAX_GENERATED_ROWS), so the two streams cannot meet.
EVAL_SEED_OFFSET = 2**40
MAX_GENERATED_ROWS = 2**32


def question_key(question: Any) -> str:
    """A question's identity for the held-out split: its text with case and runs of whitespace
    ignored ("What is 2+2?" and "what is  2+2? " are one question)."""
    return " ".join(str(question).split()).casefold()


def overlap_fraction(eval_rows: list[dict[str, Any]], train_rows: list[dict[str, Any]]) -> float:
    """The fraction of the eval set's distinct questions that are also in the training pool."""
    asked = {question_key(r["question"]) for r in eval_rows}
    if not asked:
        return 0.0
    pool = {question_key(r["question"]) for r in train_rows}
    return len(asked & pool) / len(asked)


def distinct_questions(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first row of each question, in order: an eval set asks each question once."""
    seen: set[str] = set()
    out = []
    for row in rows:
        key = question_key(row["question"])
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


@dataclass
class LoadedData:
    """The training pool and the eval sets (name -> rows), disjoint by question unless the spec
    says an overlap is intended (``data.allow_eval_overlap``). ``overlap`` is what was measured
    per eval set: the fraction of its questions also in ``train``."""

    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    eval_sets: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    overlap: dict[str, float] = field(default_factory=dict)
    removed_from_train: int = 0  # training rows dropped because an eval set asks their question

    def __post_init__(self) -> None:
        if not self.eval_sets:
            self.eval_sets = {DEFAULT_EVAL_SET: self.eval}


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


def load_run_data(spec: Any) -> LoadedData:
    """A run's data as its spec says: the training pool, its own held-out split and the named
    eval sets (``eval.sets``), every eval question out of the pool (the one rule every caller
    that trains or evaluates a run goes through)."""
    return load_data(spec.data, spec.seed, named=named_eval_sets(spec.eval.sets, spec.eval.size))


def named_eval_sets(sets: Sequence[Any], default_size: int) -> dict[str, list[dict[str, Any]]]:
    """``eval.sets``: each file's distinct questions (first row of each, file order), at most
    ``size`` (or ``eval.size``) of them."""
    out: dict[str, list[dict[str, Any]]] = {}
    for i, s in enumerate(sets):
        try:
            rows = distinct_questions(load_rows(s.source, options={}, size=0, seed=0,
                                                question_field=s.question_field,
                                                answer_field=s.answer_field))
        except DatasetError as exc:
            raise DatasetError(f"eval.sets[{i}] ({s.name}): {exc}") from None
        if not rows:
            raise DatasetError(f"eval.sets[{i}] ({s.name}): {s.source} has no rows")
        out[s.name] = rows[: s.size or default_size]
    return out


def load_data(spec_data: Any, seed: int,
              named: dict[str, list[dict[str, Any]]] | None = None) -> LoadedData:
    """The training pool and the held-out eval set, disjoint by question (:func:`question_key`).

    Generators draw eval rows from their own seed stream (EVAL_SEED_OFFSET), each question
    once; files split by distinct question, so every copy of a question lands on one side. Either
    way at most ``data.eval_size`` questions are held out, and at most a fifth of the training
    draw's distinct questions leave it for them. Then every training row that asks an eval
    question is removed (a generator with a small question space repeats questions across
    streams), unless ``data.allow_eval_overlap`` says an in-sample evaluation is intended. The
    measured overlap is kept per set; one above 0 that the spec did not allow is an error.
    ``named`` eval sets (``eval.sets``, :func:`named_eval_sets`) leave the pool the same way."""
    kind = spec_data.source.split(":", 1)[0]
    common = dict(options=spec_data.options, question_field=spec_data.question_field,
                  answer_field=spec_data.answer_field)
    if kind in ("synthetic", "reasoning_gym"):
        if spec_data.size > MAX_GENERATED_ROWS:
            raise DatasetError(f"data.size {spec_data.size} is above {MAX_GENERATED_ROWS}: the "
                               "eval seed stream must stay out of the training seeds' reach; lower data.size")
        train = load_rows(spec_data.source, size=spec_data.size, seed=seed, **common)
        evals = _generated_eval(spec_data, train, seed, common)
    else:
        rows = load_rows(spec_data.source, size=spec_data.size, seed=seed, **common)
        if not rows:
            raise DatasetError(f"data.source {spec_data.source!r} has no rows")
        train, evals = split_by_question(rows, spec_data.eval_size, seed)
        if getattr(spec_data, "allow_eval_overlap", False):
            train = rows  # in-sample on purpose: the eval questions stay in the pool too
    return held_out(train, {DEFAULT_EVAL_SET: evals, **(named or {})},
                    allow_overlap=bool(getattr(spec_data, "allow_eval_overlap", False)),
                    source=spec_data.source)


def _generated_eval(spec_data: Any, train: list[dict[str, Any]], seed: int,
                    common: dict[str, Any]) -> list[dict[str, Any]]:
    """Up to ``eval_size`` distinct questions from the eval seed stream. A question the training
    draw also holds will leave training; as for files, at most a fifth of the draw's distinct
    questions may (a small space, two terms of 0..9: 100 questions, keeps 80 to train on), and
    past that only questions training never draws are taken. A small space repeats itself, so up
    to four times ``eval_size`` rows are drawn to find them."""
    want = spec_data.eval_size
    if want == 0:
        return []
    pool = {question_key(r["question"]) for r in train}
    may_take = len(pool) // 5
    for draw in (want, 4 * want):
        taken, from_pool = [], 0
        for row in distinct_questions(load_rows(spec_data.source, size=draw,
                                                seed=seed + EVAL_SEED_OFFSET, **common)):
            in_pool = question_key(row["question"]) in pool
            if in_pool and from_pool >= may_take:
                continue
            from_pool += in_pool
            taken.append(row)
            if len(taken) == want:
                return taken
    return taken


def split_by_question(rows: list[dict[str, Any]], eval_size: int,
                      seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A file's rows split by distinct question: a seeded shuffle of the questions, the first
    ``min(eval_size, questions // 5)`` held out (their first row each), every row of the others
    trained on. Copies of an eval question never reach training."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(question_key(row["question"]), []).append(row)
    keys = list(groups)
    random.Random(seed).shuffle(keys)
    n_eval = min(eval_size, len(keys) // 5)
    evals = [groups[k][0] for k in keys[:n_eval]]
    held = set(keys[:n_eval])
    return [r for r in rows if question_key(r["question"]) not in held], evals


def held_out(train: list[dict[str, Any]], eval_sets: dict[str, list[dict[str, Any]]], *,
             allow_overlap: bool, source: str) -> LoadedData:
    """Remove every eval question from the training pool (unless ``allow_overlap``), measure
    what overlap is left per set, and refuse one the spec did not allow."""
    removed = 0
    if not allow_overlap:
        asked = {question_key(r["question"]) for rows in eval_sets.values() for r in rows}
        kept = [r for r in train if question_key(r["question"]) not in asked]
        removed, train = len(train) - len(kept), kept
        if not train:
            raise DatasetError(
                f"data.source {source!r}: every training question is also an eval question, so "
                "nothing is left to train on; lower data.eval_size, widen the generator's "
                "question space (data.options), or set data.allow_eval_overlap: true for an "
                "in-sample evaluation")
    overlap = {name: overlap_fraction(rows, train) for name, rows in eval_sets.items()}
    leaked = {name: value for name, value in overlap.items() if value > 0}
    if leaked and not allow_overlap:  # the removal above makes this a broken invariant
        raise DatasetError(f"eval sets {sorted(leaked)} share questions with the training pool "
                           f"({leaked}); set data.allow_eval_overlap: true if that is intended")
    first = next(iter(eval_sets.values()), [])
    return LoadedData(train, first, dict(eval_sets), overlap, removed)


def warm_start_rows(spec_data: Any, seed: int,
                    named: dict[str, list[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """Rows for a supervised warm start (training_core/sft.py): another draw than the RL run's
    first (seed + 1), without the RL run's eval questions (its own split and the ``named`` sets),
    which no training may see; unless the spec evaluates in-sample on purpose
    (``data.allow_eval_overlap``): the warm start is training too, and then sees its own split's
    questions as the RL run does."""
    run = load_data(spec_data, seed, named=named)
    draw = load_data(spec_data, seed + 1, named=named).train
    if getattr(spec_data, "allow_eval_overlap", False):
        return draw + run.eval
    held = {question_key(r["question"]) for rows in run.eval_sets.values() for r in rows}
    return [r for r in draw if question_key(r["question"]) not in held]


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


class TrainedQuestions:
    """The questions of the prompts training batches held so far (by stream index), to measure
    how many eval questions a run really trained on: 0 when eval sets are held out, the
    in-sample share when ``data.allow_eval_overlap`` kept them. It maps indices with its own
    :class:`PromptLoader` over the same rows and seed: the executor's caches an epoch's order
    and is read from the rollout thread."""

    def __init__(self, rows: list[dict[str, Any]], seed: int):
        self._loader = PromptLoader(rows, seed)
        self.keys: set[str] = set()

    def add(self, indices: list[int]) -> None:
        self.keys.update(question_key(self._loader.row(i)["question"]) for i in indices if i >= 0)

    def fraction(self, eval_rows: list[dict[str, Any]]) -> float:
        """The fraction of the eval set's distinct questions some training batch held."""
        asked = {question_key(r["question"]) for r in eval_rows}
        return len(asked & self.keys) / len(asked) if asked else 0.0
