import asyncio
import time

import pytest

from training_core.rewards.builtin import (
    BuiltinReward,
    extract_answer_tag,
    extract_boxed,
    extract_gsm8k,
    extract_last_number,
    reasoning_gym_answer,
)
from training_core.rewards.pool import RewardPool
from training_core.rewards.registry import resolve_reward


def test_extractors():
    assert extract_gsm8k("so 3 + 4 = 7\n#### 1,234") == "1,234"
    assert extract_boxed(r"the answer is \boxed{\frac{1}{2}} or 3") == r"\frac{1}{2}"
    assert extract_last_number("first 3 then 42.") == "42"
    assert extract_last_number("no digits") is None
    assert extract_answer_tag("<answer>1</answer> then <answer> 7 </answer>") == "7"
    assert extract_answer_tag("no tags") is None


def test_builtin_scores_after_extraction():
    assert BuiltinReward("numeric")("it is 1,234", {"answer": "1234"}) == 1.0
    assert BuiltinReward("numeric")("it is 1235", {"answer": "1234"}) == 0.0
    assert BuiltinReward("exact")(" 12 ", {"answer": "12"}) == 1.0
    assert BuiltinReward("gsm8k")("Natalia sold 48/2 = 24 clips.\n#### 72", {"answer": "72"}) == 1.0
    assert BuiltinReward("math")(r"Thus $\boxed{\frac{1}{2}}$", {"answer": "0.5"}) == 1.0
    assert BuiltinReward("math")(r"Thus $\boxed{\frac{1}{3}}$", {"answer": "0.5"}) == 0.0


@pytest.mark.parametrize("name,completion,answer", [
    # What SmolLM2-135M-Instruct writes when asked a question: right, but not bare.
    ("numeric", "The answer is 42.", "42"),
    ("gsm8k", "She has 40 + 2 = 42 apples. The answer is 42.", "42"),
    ("math", "Adding them gives 42. So the answer is $\\boxed{42}$.", "42"),
    ("exact", "Let me think. <answer>42</answer>", "42"),
])
def test_real_model_answers_that_are_right_but_not_bare_score_one(name, completion, answer):
    reward = BuiltinReward(name)
    assert reward(completion, {"answer": answer}) == 1.0
    # Without extraction the same completion scores 0 (what the issue saw); math-verify parses
    # LaTeX itself, so math is the exception.
    if name != "math":
        assert BuiltinReward(name, extract="none")(completion, {"answer": answer}) == 0.0


def test_reasoning_gym_extracts_the_answer_tag_its_prompts_ask_for():
    from training_core.data.datasets import reasoning_gym_rows
    from training_core.data.templates import prompt_template_text

    row = reasoning_gym_rows("basic_arithmetic", 1, 0, {})[0]
    completion = f"First I add the numbers. The result is {row['answer']}.\n<answer>{row['answer']}</answer>"
    reward = BuiltinReward("reasoning_gym")
    assert reward(completion, row) == 1.0
    assert reward.extracted(completion) == str(row["answer"])
    assert "<answer>" in prompt_template_text("reasoning_gym")
    assert prompt_template_text("gsm8k").format(question="q").startswith("q")


def test_extract_option_is_named_and_validated():
    assert resolve_reward("builtin:math", "last_number").extracted("x \\boxed{3} then 4") == "4"
    assert resolve_reward("builtin:math").extracted("x \\boxed{3} then 4") == "3"
    with pytest.raises(ValueError, match="reward.extract 'xml' is unknown"):
        resolve_reward("builtin:math", "xml")
    with pytest.raises(ValueError, match="built-in rewards only"):
        resolve_reward("tests.training_core.rewards_for_tests:digit_reward", "boxed")


def test_reasoning_gym_scorer_is_used():
    from training_core.data.datasets import reasoning_gym_rows

    row = reasoning_gym_rows("basic_arithmetic", 1, 0, {})[0]
    reward = BuiltinReward("reasoning_gym")
    assert reward(f"<answer>{row['answer']}</answer>", row) == 1.0
    assert reward("definitely wrong", row) < 1.0
    # The scorer sees only what the extractor found.
    assert reasoning_gym_answer(row["answer"], row) == 1.0


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
    assert good.reward == 1.0 and good.error is None and good.extracted == "3,7"
    assert err.reward == 0.0 and "user reward bug" in err.error
    assert late.reward == 0.0 and "timed out" in late.error and took < 10
    assert again.reward == 0.0 and failures == 2


def test_reward_memory_mb_from_the_spec_bounds_the_jail():
    """reward.memory_mb reaches the pool's jail: 700 MB fit the default and fail at 512 MB."""
    from training_core.config import RewardSpec

    def pool(**spec) -> RewardPool:
        return RewardPool.from_spec(RewardSpec(fn="tests.training_core.rewards_for_tests:needs_700_mb",
                                               timeout_s=60, **spec))

    async def scenario():
        pools = pool(), pool(memory_mb=512)
        try:
            return [await p.score("x", {"answer": "1"}) for p in pools]
        finally:
            for p in pools:
                p.close()

    roomy, tight = asyncio.run(scenario())
    assert roomy.reward == 1.0 and roomy.error is None, roomy
    assert tight.reward == 0.0 and "MemoryError" in (tight.error or ""), tight


def test_reward_memory_mb_is_validated_by_name():
    from pydantic import ValidationError

    from training_core.config import RewardSpec

    with pytest.raises(ValidationError, match="memory_mb"):
        RewardSpec(memory_mb=100)


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
