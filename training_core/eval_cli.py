"""``oolong eval``: a stored weight version of a finished run, evaluated on an eval set.

    oolong eval runs/demo-20261122-101500                      # the last version, its own set
    oolong eval runs/demo --version 100 --samples 8 --k 4     # avg@4, pass@4, maj@4 too
    oolong eval runs/demo --data jsonl:test.jsonl --name test --out test-eval.json

The run's own eval set (or one of its ``eval.sets``, by ``--name``) is rebuilt from its spec
(the same split, held out of its training pool); another set (``--data``, any ``data.source``) is checked against the run's training pool first:
an overlap is an error unless ``--allow-overlap`` says an in-sample evaluation is intended. The
numbers are :func:`training_core.offline_eval.evaluate_version`'s, generated in this process.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any


class EvalCommandError(ValueError):
    """A bad argument of ``oolong eval``, named with its fix."""


def stored_eval(run_dir: str | Path, *, version: int | None = None, data: str | None = None,
                name: str | None = None, samples: int | None = None, k: int | None = None,
                limit: int | None = None, allow_overlap: bool = False) -> dict[str, Any]:
    """``{"run_dir", "version", "set", "metrics"}`` for one stored version on one eval set."""
    from training_core.checkpoint import pushed_weights
    from training_core.config import load_spec
    from training_core.data.datasets import (
        distinct_questions,
        load_rows,
        load_run_data,
        overlap_fraction,
    )
    from training_core.metric_names import DEFAULT_EVAL_SET
    from training_core.models.paths import run_model_dir
    from training_core.offline_eval import evaluate_version

    run_dir = Path(run_dir)
    if not (run_dir / "spec.yaml").exists():
        raise EvalCommandError(f"run directory {run_dir}: no spec.yaml there (give the folder a "
                               "run wrote, e.g. runs/demo-20261122-101500)")
    spec = load_spec(run_dir / "spec.yaml", [])
    weights = dict(pushed_weights(run_dir))
    if version is None:
        version = max(weights, default=0)
    if version != 0 and version not in weights:
        raise EvalCommandError(f"--version {version}: the run stored no such weights; it has "
                               f"{sorted(weights) or 'none'} (0 is the starting model)")
    samples = spec.eval.samples if samples is None else samples
    k = (spec.eval.k if samples == spec.eval.samples else None) if k is None else k
    if samples < 0 or (k is not None and not 1 <= k <= samples):
        raise EvalCommandError(f"--k {k} with --samples {samples}: k must be within 1..samples "
                               "(pass@k needs at least k samples per question)")
    run_data = load_run_data(spec)  # the run's own split and eval.sets: its training pool
    if data is None:
        set_name = name or DEFAULT_EVAL_SET
        if set_name not in run_data.eval_sets:
            raise EvalCommandError(f"--name {set_name!r}: the run has no such eval set; it has "
                                   f"{sorted(run_data.eval_sets)} (or give --data)")
        rows = run_data.eval_sets[set_name]
        rows = rows[: spec.eval.size] if set_name == DEFAULT_EVAL_SET else rows
        overlap = run_data.overlap.get(set_name, 0.0)
    else:
        set_name = name or re.sub(r"[^A-Za-z0-9_-]+", "_", Path(data.partition(":")[2]).stem)
        rows = distinct_questions(load_rows(
            data, options=spec.data.options, size=limit or spec.data.size, seed=spec.seed,
            question_field=spec.data.question_field, answer_field=spec.data.answer_field))
        overlap = overlap_fraction(rows, run_data.train)
        if overlap > 0 and not (allow_overlap or spec.data.allow_eval_overlap):
            raise EvalCommandError(
                f"--data {data}: {overlap:.1%} of its questions are in the run's training pool, "
                "so the evaluation would be in-sample; pass --allow-overlap if that is intended")
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", set_name):
        raise EvalCommandError(f"--name {set_name!r}: use 1-40 letters, digits, _ or -")
    rows = rows[:limit] if limit else rows
    if not rows:
        raise EvalCommandError(f"eval set {set_name!r} has no rows (data.eval_size, --data)")
    metrics = evaluate_version(spec, run_model_dir(spec, run_dir), weights.get(version),
                               {set_name: rows}, version=version, samples=samples, k=k,
                               overlap={set_name: overlap})
    return {"run_dir": str(run_dir), "version": version, "set": set_name, "metrics": metrics}


def cmd_eval(args: Any) -> int:
    import sys

    try:
        result = stored_eval(args.run_dir, version=args.version, data=args.data, name=args.name,
                             samples=args.samples, k=args.k, limit=args.limit,
                             allow_overlap=args.allow_overlap)
    except EvalCommandError as exc:
        print(exc, file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


def add_eval_parser(sub: Any) -> None:
    e = sub.add_parser("eval", help="evaluate a stored weight version of a run on an eval set")
    e.add_argument("run_dir", help="the run's directory (holds spec.yaml and weights/)")
    e.add_argument("--version", type=int, default=None,
                   help="the weight version (weights/v<N>); default the last; 0 the start")
    e.add_argument("--data", default=None,
                   help="another eval set as a data.source (jsonl:PATH, ...); default the run's own")
    e.add_argument("--name", default=None, help="the set's name in eval/<set>/... keys")
    e.add_argument("--samples", type=int, default=None,
                   help="completions sampled per question; default the run's eval.samples")
    e.add_argument("--k", type=int, default=None, help="k of avg@k, pass@k, maj@k (<= samples)")
    e.add_argument("--limit", type=int, default=None, help="at most this many questions")
    e.add_argument("--allow-overlap", action="store_true",
                   help="accept an eval set that shares questions with the training pool")
    e.add_argument("--out", default=None, help="also write the JSON here")
    e.set_defaults(fn=cmd_eval)
