"""The statistics of an evaluation, as pure functions: pass@k, majority votes, 95% intervals.

Per eval set, over its questions (training_core/evaluation.py draws the completions):

- greedy accuracy: the fraction of questions whose greedy completion is correct;
- avg@k: the mean over questions of c / n, a question's fraction of correct samples (n samples
  drawn, c correct): the expected accuracy of one sample (verl's ``mean@N``);
- pass@k: the mean over questions of the unbiased estimator of Chen et al. 2021 (Codex),
  1 - C(n - c, k) / C(n, k), the probability that at least one of k samples drawn without
  replacement from the n is correct;
- maj@k: the fraction of questions whose majority answer among the first k samples (the
  answers the reward extracted; ties go to the answer seen first) is correct.

Intervals at 95%: Wilson score intervals for the proportions of questions (greedy, maj@k: one
right-or-wrong outcome per question; Wilson keeps its width at 0% and 100%, where the normal
interval collapses to a point); a normal interval over questions (mean +- 1.96 s / sqrt(q), s the
sample std of the per-question values, clipped to [0, 1]) for avg@k and pass@k, whose
per-question values are fractions. Questions are the unit: samples of one question are not
independent evidence about the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k from ``n`` samples of which ``c`` are correct:
    1 - C(n - c, k) / C(n, k), as a running product (no huge binomials)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: c ({c}) must be within 0..n ({n})")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k: k ({k}) must be within 1..n ({n}): draw at least k samples")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(k):  # C(n - c, k) / C(n, k) = prod_{i<k} (n - c - i) / (n - i)
        miss *= (n - c - i) / (n - i)
    return 1.0 - miss


def wilson_interval(successes: int, total: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion; (0, 1) when there is nothing to count."""
    if total <= 0:
        return 0.0, 1.0
    p = successes / total
    denom = 1.0 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_interval(values: Sequence[float], z: float = Z95) -> tuple[float, float, float]:
    """(mean, low, high): a normal interval over ``values`` (fractions, one per question),
    clipped to [0, 1]; with fewer than two values the interval is all of [0, 1]."""
    if not values:
        return 0.0, 0.0, 1.0
    q = len(values)
    mean = sum(values) / q
    if q < 2:
        return mean, 0.0, 1.0
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (q - 1))
    half = z * sd / math.sqrt(q)
    return mean, max(0.0, mean - half), min(1.0, mean + half)


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """Whether the most frequent extracted answer is a correct one. A sample without an answer
    (None) does not vote; ties go to the answer seen first; no answer at all is wrong."""
    counts: dict[str, int] = {}
    right: dict[str, bool] = {}
    for answer, ok in zip(answers, correct, strict=True):
        if answer is None:
            continue
        counts[answer] = counts.get(answer, 0) + 1
        right[answer] = right.get(answer, False) or ok
    if not counts:
        return False
    top = max(counts.values())
    winner = next(a for a, n in counts.items() if n == top)  # dicts keep first-seen order
    return right[winner]


def set_statistics(greedy: Sequence[bool], samples: Sequence[Sequence[bool]] | None = None,
                   answers: Sequence[Sequence[str | None]] | None = None,
                   k: int | None = None) -> dict[str, float]:
    """Every statistic of one eval set, keyed by its short name (evaluation.py prefixes
    ``eval/<set>/``). ``greedy``: per question, whether its greedy completion was right;
    ``samples``: per question, whether each of its n samples was; ``answers``: their extracted
    answers (for maj@k); ``k``: at most n (default n)."""
    q = len(greedy)
    wins = sum(bool(g) for g in greedy)
    lo, hi = wilson_interval(wins, q)
    out = {"questions": float(q), "greedy_accuracy": wins / q if q else 0.0,
           "greedy_accuracy_ci_lo": lo, "greedy_accuracy_ci_hi": hi}
    if not samples:
        return out
    n = min(len(s) for s in samples)
    if n == 0:
        return out
    k = n if k is None else k
    if not 1 <= k <= n:
        raise ValueError(f"eval.k ({k}) must be within 1..{n}, the samples drawn per question")
    per_avg = [sum(map(bool, s[:n])) / n for s in samples]
    per_pass = [pass_at_k(n, sum(map(bool, s[:n])), k) for s in samples]
    for name, values in (("avg@k", per_avg), ("pass@k", per_pass)):
        mean, lo, hi = mean_interval(values)
        out.update({name: mean, f"{name}_ci_lo": lo, f"{name}_ci_hi": hi})
    if answers is not None:
        maj = sum(majority_correct(a[:k], s[:k]) for a, s in zip(answers, samples, strict=True))
        lo, hi = wilson_interval(maj, len(samples))
        out.update({"maj@k": maj / len(samples), "maj@k_ci_lo": lo, "maj@k_ci_hi": hi})
    out.update({"k": float(k), "n": float(n)})
    return out
