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
