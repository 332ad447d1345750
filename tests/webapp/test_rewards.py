import pytest

from webapp.core.errors import ApplicationError
from webapp.rewards.models import RewardFunction, RewardFunctionVersion
from webapp.rewards.services import reward_function_create, reward_validation_record

pytestmark = pytest.mark.django_db

GOOD = "def reward(completion, item):\n    return float(completion.strip() == item['answer'])\n"


def test_builtin_is_valid_immediately(project, alice):
    v = reward_function_create(project=project, user=alice, name="m", builtin="math")
    assert v.status == "valid" and v.fn_path == "builtin:math"


def test_user_code_is_pending_until_a_worker_validates_it(project, alice):
    v = reward_function_create(project=project, user=alice, name="mine", source=GOOD)
    assert v.status == "pending" and v.fn_path.endswith(":reward")
    reward_validation_record(version=v, report={"ok": True, "samples": [{"reward": 1.0}]})
    v.refresh_from_db()
    assert v.status == "valid"
    v2 = reward_function_create(project=project, user=alice, name="mine", source=GOOD + "\n# v2\n")
    assert v2.version == 2


@pytest.mark.parametrize("source,entrypoint,field,fragment", [
    ("def reward(c, i):\n  return (", "reward", "source", "syntax error on line 2"),
    ("def other(c, i):\n  return 1\n", "reward", "entrypoint", "no top-level function 'reward'"),
    ("def reward(c):\n  return 1\n", "reward", "entrypoint", "two arguments"),
])
def test_bad_code_is_refused_and_nothing_stored(project, alice, source, entrypoint, field, fragment):
    with pytest.raises(ApplicationError) as err:
        reward_function_create(project=project, user=alice, name="bad", source=source, entrypoint=entrypoint)
    assert err.value.errors[0]["field"] == field and fragment in err.value.message
    assert not RewardFunction.objects.exists() and not RewardFunctionVersion.objects.exists()


def test_unknown_builtin(project, alice):
    with pytest.raises(ApplicationError, match="unknown built-in"):
        reward_function_create(project=project, user=alice, name="x", builtin="nope")


def test_api_create_list_and_isolation(api, bob_api, project):
    r = api.post("/api/rewards/", {"project": project.id, "name": "ex", "builtin": "exact"}, format="json")
    assert r.status_code == 201 and r.json()["status"] == "valid"
    assert [x["name"] for x in api.get("/api/rewards/").json()] == ["ex"]
    assert bob_api.get("/api/rewards/").json() == []
    r = api.post("/api/rewards/", {"project": project.id, "name": "bad", "source": "def f(:"}, format="json")
    assert r.status_code == 400 and r.json()["errors"][0]["field"] == "source"


@pytest.mark.parametrize("asked,fragment", [
    (4096, "allows at most 2048 (OOLONG_REWARD_MAX_MEMORY_MB"),  # more than the worker grants
    (-5, "whole number of MB >= 256"),  # a negative rlimit would lift the address-space limit
    ("abc", "whole number of MB >= 256"),
])
def test_a_remote_reward_task_gets_only_the_memory_the_worker_grants(monkeypatch, asked, fragment):
    """Task arguments come off the broker: the worker refuses what it does not grant, naming
    both numbers, before any jail starts."""
    from webapp.rewards.validation import reward_score_remote

    monkeypatch.delenv("OOLONG_REWARD_MAX_MEMORY_MB", raising=False)
    out = reward_score_remote(fn_path="m:reward", source="def reward(c, i):\n    return 1.0\n",
                              completion="x", item={}, memory_mb=asked)
    assert out["reward"] == 0.0 and fragment in out["error"]


def test_a_remote_reward_task_with_a_nonsense_deadline_runs_under_the_default(monkeypatch):
    """A NaN or negative timeout from the broker falls back to the default instead of reaching
    the jail's select (where it raised and left the jail behind); an operator's larger grant
    lets a run's memory through."""
    from webapp.rewards.validation import _remote_limits

    monkeypatch.setenv("OOLONG_REWARD_MAX_MEMORY_MB", "8192")
    assert _remote_limits(float("nan"), None) == (10.0, None, None)
    assert _remote_limits(-3, 4096) == (10.0, 4096, None)
    assert _remote_limits("soon", None)[0] == 10.0
    assert _remote_limits(1e9, None)[0] == 285.0  # under the task's own 300 s soft limit
