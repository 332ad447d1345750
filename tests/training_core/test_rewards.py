import asyncio
import time

import pytest

from training_core.rewards.builtin import (
    exact_match,
    extract_final_answer,
    gsm8k_answer,
    math_answer,
    numeric_match,
    reasoning_gym_answer,
)
from training_core.rewards.pool import RewardPool
from training_core.rewards.registry import resolve_reward


def test_extract_final_answer_prefers_gsm8k_then_boxed_then_last_number():
    assert extract_final_answer("so 3 + 4 = 7\n#### 1,234") == "1,234"
    assert extract_final_answer(r"the answer is \boxed{\frac{1}{2}} or 3") == r"\frac{1}{2}"
    assert extract_final_answer("first 3 then 42.") == "42"
    assert extract_final_answer("no digits") is None


def test_numeric_and_exact():
    assert numeric_match("it is 1,234", {"answer": "1234"}) == 1.0
    assert numeric_match("it is 1235", {"answer": "1234"}) == 0.0
    assert exact_match(" 12 ", {"answer": "12"}) == 1.0
    assert gsm8k_answer("Natalia sold 48/2 = 24 clips.\n#### 72", {"answer": "72"}) == 1.0


def test_math_verify_handles_latex_equivalence():
    assert math_answer(r"Thus $\boxed{\frac{1}{2}}$", {"answer": "0.5"}) == 1.0
    assert math_answer(r"Thus $\boxed{\frac{1}{3}}$", {"answer": "0.5"}) == 0.0


def test_reasoning_gym_scorer_is_used():
    from training_core.data.datasets import reasoning_gym_rows

    row = reasoning_gym_rows("basic_arithmetic", 1, 0, {})[0]
    assert reasoning_gym_answer(row["answer"], row) == 1.0
    assert reasoning_gym_answer("definitely wrong", row) < 1.0


def test_registry_errors_name_the_problem():
    with pytest.raises(ValueError, match="builtin:nope is unknown"):
        resolve_reward("builtin:nope")
    with pytest.raises(ValueError, match="cannot import module"):
        resolve_reward("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="no function"):
        resolve_reward("training_core.rewards.builtin:missing")


def test_pool_scores_and_survives_exceptions_and_timeouts():
    async def scenario():
        ok = RewardPool("builtin:arithmetic", workers=1, timeout_s=5)
        bad = RewardPool("tests.training_core.rewards_for_tests:raises", workers=1, timeout_s=5)
        slow = RewardPool("tests.training_core.rewards_for_tests:sleeps", workers=1, timeout_s=1)
        try:
            good = await ok.score("3,7", {"answer": "7"})
            err = await bad.score("x", {"answer": "1"})
            start = time.perf_counter()
            late = await slow.score("x", {"answer": "1"})
            took = time.perf_counter() - start
            # The stuck worker was replaced: the pool still answers.
            again = await slow.score("x", {"answer": "1"})
            return good, err, late, took, again, slow.failures
        finally:
            ok.close(), bad.close(), slow.close()

    good, err, late, took, again, failures = asyncio.run(scenario())
    assert good.reward == 1.0 and good.error is None
    assert err.reward == 0.0 and "user reward bug" in err.error
    assert late.reward == 0.0 and "timed out" in late.error and took < 10
    assert again.reward == 0.0 and failures == 2


def test_inline_executor():
    async def scenario():
        pool = RewardPool("builtin:exact", executor="inline")
        return await pool.score("a", {"answer": "a"})

    assert asyncio.run(scenario()).reward == 1.0


def test_user_reward_module_path_round_trips():
    from training_core.rewards.registry import USER_REWARD, user_reward_fn_path

    path = user_reward_fn_path(12, 3, "score")
    assert path == "oolong_user_rewards.r12_v3:score"
    assert USER_REWARD.match(path).groups() == ("r12_v3", "score")
    assert USER_REWARD.match("other_pkg.r1_v1:score") is None
