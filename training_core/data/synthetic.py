"""A procedural arithmetic task with a short reasoning trace, for the CPU demo and benchmarks.

Prompt ``"7+12+5="``, target completion ``"7,19,24"``: the running sums, the last one being the
answer. The number of terms controls the response length, so a spread of ``terms`` gives the
realistic spread of response lengths that makes synchronous RL wait for its longest sample.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any


def arithmetic_item(rng: random.Random, *, min_terms: int = 2, max_terms: int = 2,
                    max_value: int = 50, long_tail: float = 0.0,
                    tail_terms: int | None = None) -> dict[str, Any]:
    k = rng.randint(min_terms, max_terms)
    if long_tail > 0 and rng.random() < long_tail:
        k = tail_terms or max_terms  # a few long samples, as in real reasoning traces
    terms = [rng.randint(0, max_value) for _ in range(k)]
    sums, total = [], 0
    for t in terms:
        total += t
        sums.append(total)
    return {
        "question": "+".join(map(str, terms)) + "=",
        "answer": str(total),
        "solution": ",".join(map(str, sums)),
    }


def arithmetic_items(n: int, seed: int, **options: Any) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [arithmetic_item(rng, **options) for _ in range(n)]


def arithmetic_stream(seed: int, **options: Any) -> Iterator[dict[str, Any]]:
    rng = random.Random(seed)
    while True:
        yield arithmetic_item(rng, **options)


def arithmetic_score(completion: str, item: dict[str, Any]) -> float:
    """1 if the last comma-separated number equals the answer, else 0."""
    text = completion.strip().rstrip(".")
    last = text.split(",")[-1].strip() if text else ""
    return 1.0 if last == str(item["answer"]).strip() else 0.0
