"""Rewards that work where they run (issue 25.1): every built-in family and a user reward that
imports ssl/urllib/json/re/numpy, scored through the jailed RewardPool (``executor: process``)
on real rows of its source. A right answer scores > 0 and a wrong one less, with no error."""

from __future__ import annotations

import asyncio
import json

import pytest

from training_core.data.datasets import load_rows
from training_core.rewards.pool import RewardPool

RG_GENERATORS = ["basic_arithmetic", "chain_sum", "leg_counting", "word_sorting", "gcd"]


def _score_all(fn_path: str, calls: list[tuple[str, dict]]):
    async def go():
        pool = RewardPool(fn_path, workers=1, timeout_s=60, executor="process")
        try:
            return [await pool.score(completion, item) for completion, item in calls]
        finally:
            pool.close()

    return asyncio.run(go())


def _assert_right_beats_wrong(results, n: int):
    """results = [right_1, wrong_1, right_2, wrong_2, ...]"""
    assert len(results) == 2 * n
    for result in results:
        assert result.error is None, result
    for right, wrong in zip(results[::2], results[1::2], strict=True):
        assert right.reward > 0 and wrong.reward < right.reward, (right, wrong)


def test_reasoning_gym_generators_score_through_the_jail():
    calls = []
    for name in RG_GENERATORS:
        for row in load_rows(f"reasoning_gym:{name}", options={}, size=2, seed=3):
            calls.append((f"Let me work it out.\n<answer>{row['answer']}</answer>", row))
            calls.append(("<answer>definitely not it 123456789</answer>", row))
    results = _score_all("builtin:reasoning_gym", calls)
    _assert_right_beats_wrong(results, len(calls) // 2)
    assert results[0].extracted == calls[0][1]["answer"]


def _jsonl(tmp_path, rows):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_rows_score_through_the_jail(tmp_path):
    # GSM8K's own format: the answer is a worked solution ending in "#### N".
    path = _jsonl(tmp_path, [
        {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
                     "many clips in May. How many clips did Natalia sell altogether?",
         "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                   "Natalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 72"},
        {"question": "A shop sells 1,200 pens a week. How many in 3 weeks?",
         "answer": "1,200 * 3 = 3,600\n#### 3,600"},
    ])
    rows = load_rows(f"gsm8k:{path}", options={}, size=10, seed=0)
    calls = []
    for row in rows:
        calls.append((f"Step by step... so the total is {row['answer']}.\n#### {row['answer']}", row))
        calls.append(("Step by step...\n#### 5", row))
    _assert_right_beats_wrong(_score_all("builtin:gsm8k", calls), len(rows))


def test_math_rows_score_through_the_jail_with_math_verify(tmp_path):
    # MATH-style rows: LaTeX answers; math-verify accepts an equivalent form.
    path = _jsonl(tmp_path, [
        {"question": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "answer": "\\frac{3}{4}"},
        {"question": "Solve $x^2 = 16$ for $x > 0$.", "answer": "4"},
        {"question": "Simplify $\\sqrt{8}$.", "answer": "2\\sqrt{2}"},
    ])
    rows = load_rows(f"jsonl:{path}", options={}, size=10, seed=0)
    right = ["So the sum is $\\boxed{0.75}$.", "Hence $x = \\boxed{4}$.",
             "We get $\\boxed{2\\sqrt{2}}$."]
    calls = []
    for row, good in zip(rows, right, strict=True):
        calls += [(good, row), ("So the answer is $\\boxed{7}$.", row)]
    _assert_right_beats_wrong(_score_all("builtin:math", calls), len(rows))


@pytest.mark.parametrize("family,rows,right,wrong", [
    ("numeric", [{"question": "How many legs do 3 spiders have?", "answer": "24"},
                 {"question": "What is 2.5 * 4?", "answer": "10"}],
     ["Each has 8, so <answer>24</answer>", "The product is 10.0"],
     ["<answer>23</answer>", "The product is 11"]),
    ("exact", [{"question": "Capital of France?", "answer": "Paris"},
               {"question": "Sort: b a c", "answer": "a b c"}],
     ["<answer>Paris</answer>", "a b c"],
     ["<answer>Lyon</answer>", "c b a"]),
])
def test_numeric_and_exact_rows_score_through_the_jail(tmp_path, family, rows, right, wrong):
    loaded = load_rows(f"jsonl:{_jsonl(tmp_path, rows)}", options={}, size=10, seed=0)
    calls = []
    for row, good, bad in zip(loaded, right, wrong, strict=True):
        calls += [(good, row), (bad, row)]
    _assert_right_beats_wrong(_score_all(f"builtin:{family}", calls), len(loaded))


USER_REWARD = '''\
"""A user reward with the imports scorers really use (ssl and urllib broke the old jail)."""
import json
import re
import ssl
import urllib.request

import numpy as np

CONTEXT = ssl.create_default_context  # the class hierarchy ssl builds on socket must be intact
OPENER = urllib.request.build_opener


def reward(completion, item):
    numbers = [float(x) for x in re.findall(r"-?\\d+(?:\\.\\d+)?", completion)]
    if not numbers:
        return 0.0
    gold = float(json.loads(json.dumps(item))["answer"])
    return float(np.exp(-abs(numbers[-1] - gold)))
'''


def test_a_user_reward_importing_ssl_urllib_json_re_numpy_scores(tmp_path, monkeypatch):
    (tmp_path / "user_scorer.py").write_text(USER_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"question": "2+3?", "answer": "5"}, {"question": "10-4?", "answer": "6"}]
    calls = [("It is 5", rows[0]), ("It is 9", rows[0]), ("6", rows[1]), ("-6", rows[1])]
    results = _score_all("user_scorer:reward", calls)
    _assert_right_beats_wrong(results, 2)
    assert results[0].reward == pytest.approx(1.0) and results[1].reward == pytest.approx(2.718281828 ** -4)
