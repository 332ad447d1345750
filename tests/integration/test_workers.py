"""User reward code validated by a real Celery worker, and the remote reward backend."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.conftest import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

BAD = {
    # An endless loop is stopped by whichever limit comes first under load: wall clock or CPU.
    "loops": ("def reward(completion, item):\n    while True:\n        pass\n", ("timed out", "CPU time limit")),
    "hog": ("def reward(completion, item):\n    x = bytearray(10 * 1024**3)\n    return 1.0\n", ("MemoryError",)),
    "net": ("import socket\ndef reward(completion, item):\n"
            "    socket.create_connection(('127.0.0.1', 6379))\n    return 1.0\n", ("network",)),
}
GOOD = "def reward(completion, item):\n    return float(completion.strip() == str(item['answer']))\n"


def _status(version_id: int) -> str:
    from webapp.rewards.models import RewardFunctionVersion

    return RewardFunctionVersion.objects.get(id=version_id).status


def test_bad_reward_code_is_stopped_reported_and_the_worker_survives(stack, project_setup):
    from webapp.rewards.models import RewardFunctionVersion

    api, project = project_setup["api"], project_setup["project"]
    ids = {}
    for name, (source, _) in BAD.items():
        r = api.post("/api/rewards/", {"project": project.id, "name": name, "source": source}, format="json")
        assert r.status_code == 201 and r.json()["status"] == "pending"
        ids[name] = r.json()["id"]
    for name, (_, fragments) in BAD.items():
        wait_for(lambda n=name: _status(ids[n]) != "pending", 90, f"validation of {name}")
        v = RewardFunctionVersion.objects.get(id=ids[name])
        assert v.status == "invalid", v.validation_report
        assert any(f in v.validation_report["error"] for f in fragments), v.validation_report
    # The worker is still alive and validates good code.
    assert stack["worker"].poll() is None
    r = api.post("/api/rewards/", {"project": project.id, "name": "good", "source": GOOD}, format="json")
    wait_for(lambda: _status(r.json()["id"]) != "pending", 60, "validation of good code")
    v = RewardFunctionVersion.objects.get(id=r.json()["id"])
    assert v.status == "valid", v.validation_report
    rewards = [s["reward"] for s in v.validation_report["samples"]]
    assert 1.0 in rewards and 0.0 in rewards  # gold answers score, wrong ones do not


def test_remote_reward_backend_scores_on_the_worker_pool(stack, monkeypatch, tmp_path):
    from training_core.rewards.pool import RewardPool

    monkeypatch.setenv("OOLONG_REWARD_BROKER_URL", stack["broker"])
    monkeypatch.setenv("OOLONG_REWARD_RESULT_BACKEND", stack["broker"])

    async def scenario():
        builtin = RewardPool("builtin:arithmetic", executor="remote", timeout_s=60,
                             remote_backend="orchestration.celery_rewards:CeleryRewardBackend")
        user = RewardPool("tests.training_core.rewards_for_tests:digit_reward", executor="remote",
                          timeout_s=60, remote_backend="orchestration.celery_rewards:CeleryRewardBackend")
        # reward.extract travels with the task: the tagged answer (7) is right, the last number (8)
        # is not.
        tagged = RewardPool("builtin:arithmetic", executor="remote", timeout_s=60, extract="answer_tag",
                            remote_backend="orchestration.celery_rewards:CeleryRewardBackend")
        last = RewardPool("builtin:arithmetic", executor="remote", timeout_s=60, extract="last_number",
                          remote_backend="orchestration.celery_rewards:CeleryRewardBackend")
        pools = (builtin, user, tagged, last)
        completion = "<answer>7</answer> (not 8)"
        try:
            return (await builtin.score("3,7", {"answer": "7"}), await builtin.score("3,8", {"answer": "7"}),
                    await user.score("a1b2", {"answer": "x"}),
                    await tagged.score(completion, {"answer": "7"}),
                    await last.score(completion, {"answer": "7"}))
        finally:
            for pool in pools:
                pool.close()

    right, wrong, digits, by_tag, by_last = asyncio.run(scenario())
    assert right.reward == 1.0 and wrong.reward == 0.0
    assert by_tag.reward == 1.0 and by_last.reward == 0.0
    assert digits.reward == 0.5 and digits.error is None  # user code ran in the worker's sandbox


def test_the_remote_pool_holds_the_runs_reward_deadline_and_memory(stack, monkeypatch):
    """reward.timeout_s and reward.memory_mb travel with the task and the worker's jail holds
    them (the worker used to run every call under validation's 10 s and 2 GB)."""
    from training_core.config import RewardSpec
    from training_core.rewards.pool import RewardPool

    monkeypatch.setenv("OOLONG_REWARD_BROKER_URL", stack["broker"])
    monkeypatch.setenv("OOLONG_REWARD_RESULT_BACKEND", stack["broker"])

    def pool(fn: str, **spec) -> RewardPool:
        return RewardPool.from_spec(RewardSpec(fn=f"tests.training_core.rewards_for_tests:{fn}",
                                               executor="remote", **spec))

    async def scenario():
        pools = (pool("sleeps_3_s", timeout_s=1), pool("sleeps_3_s", timeout_s=20),
                 pool("needs_700_mb", timeout_s=60, memory_mb=512),
                 pool("needs_700_mb", timeout_s=60))
        try:
            return [await p.score("x", {"answer": "1"}) for p in pools]
        finally:
            for p in pools:
                p.close()

    late, patient, tight, roomy = asyncio.run(scenario())
    assert late.reward == 0.0 and "timed out after 1s" in (late.error or ""), late
    assert patient.reward == 1.0 and patient.error is None, patient
    assert tight.reward == 0.0 and "MemoryError" in (tight.error or ""), tight
    assert roomy.reward == 1.0 and roomy.error is None, roomy
