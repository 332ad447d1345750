"""The evaluation's statistics against their definitions (training_core/eval_stats.py)."""

from fractions import Fraction
from math import comb

import pytest

from training_core.eval_stats import (
    majority_correct,
    mean_interval,
    pass_at_k,
    set_statistics,
    wilson_interval,
)

pytestmark = pytest.mark.unit  # no process, network or database (conftest)


def test_pass_at_k_is_the_exact_combinatorial_formula():
    """Chen et al. 2021: pass@k = 1 - C(n - c, k) / C(n, k), here in exact rationals."""
    for n in range(1, 41):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - Fraction(comb(n - c, k), comb(n, k))
                assert abs(pass_at_k(n, c, k) - float(exact)) < 1e-9, (n, c, k)
    # Large n: the running product stays accurate where the binomials are astronomically large.
    exact = 1 - Fraction(comb(1000 - 3, 100), comb(1000, 100))
    assert abs(pass_at_k(1000, 3, 100) - float(exact)) < 1e-9


def test_pass_at_k_special_cases_and_bad_input():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the fraction correct
    assert pass_at_k(10, 0, 5) == 0.0 and pass_at_k(10, 6, 5) == 1.0
    with pytest.raises(ValueError, match="k \\(11\\)"):
        pass_at_k(10, 2, 11)
    with pytest.raises(ValueError, match="c \\(11\\)"):
        pass_at_k(10, 11, 1)


def test_wilson_interval_known_values():
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    lo, hi = wilson_interval(0, 20)  # keeps a width at 0%, unlike the normal interval
    assert lo == 0.0 and hi == pytest.approx(0.1611, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_mean_interval_is_normal_over_questions():
    mean, lo, hi = mean_interval([0.0, 0.5, 1.0, 0.5])
    # sample std 0.408, half width 1.96 * 0.408 / 2 = 0.400
    assert mean == 0.5 and lo == pytest.approx(0.1, abs=1e-3) and hi == pytest.approx(0.9, abs=1e-3)
    assert mean_interval([1.0, 1.0, 0.0]) [2] == 1.0  # clipped to [0, 1]
    assert mean_interval([0.3]) == (0.3, 0.0, 1.0)


def test_majority_vote_ignores_missing_answers_and_breaks_ties_by_first_seen():
    assert majority_correct(["7", "8", "7"], [True, False, True])
    assert not majority_correct(["8", "7", "8", None, None], [False, True, False, False, False])
    assert majority_correct(["7", "8"], [True, False])  # tie: the first seen wins
    assert not majority_correct(["8", "7"], [False, True])
    assert not majority_correct([None, None], [False, False])


def test_set_statistics_by_hand():
    # Three questions, 4 samples each; k = 2.
    greedy = [True, False, False]
    samples = [[True, True, False, False], [False, False, False, True], [False] * 4]
    answers = [["4", "4", "5", "6"], ["1", "2", "1", "3"], ["9", None, "9", "8"]]
    out = set_statistics(greedy, samples, answers, k=2)
    assert out["greedy_accuracy"] == pytest.approx(1 / 3) and out["questions"] == 3
    assert out["avg@k"] == pytest.approx((0.5 + 0.25 + 0) / 3)
    # pass@2 per question: 1 - C(2,2)/C(4,2) = 5/6; 1 - C(3,2)/C(4,2) = 1/2; 0
    assert out["pass@k"] == pytest.approx((5 / 6 + 1 / 2 + 0) / 3)
    # maj@2 over the first two samples: "4" right; "1"/"2" tie -> "1" wrong; "9" wrong
    assert out["maj@k"] == pytest.approx(1 / 3)
    assert out["k"] == 2 and out["n"] == 4
    for name in ("greedy_accuracy", "avg@k", "pass@k", "maj@k"):
        assert out[f"{name}_ci_lo"] <= out[name] <= out[f"{name}_ci_hi"], name
    assert set(set_statistics(greedy)) == {"questions", "greedy_accuracy",
                                           "greedy_accuracy_ci_lo", "greedy_accuracy_ci_hi"}
    with pytest.raises(ValueError, match="eval.k"):
        set_statistics(greedy, samples, answers, k=5)


def test_eval_k_above_the_samples_is_refused_naming_both_fields():
    from pydantic import ValidationError

    from training_core.config import EvalSpec

    with pytest.raises(ValidationError, match="eval.k .*eval.samples"):
        EvalSpec(samples=2, k=4)
    assert EvalSpec(samples=4, k=2).k == 2
