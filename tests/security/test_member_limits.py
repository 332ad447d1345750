"""Issue 47, item 5: quotas covered six fields, while many other member fields cost as much
(``reward.memory_mb`` up to 256 GB, an agent's memory and deadline, group sizes, thread counts,
checkpoints kept, eval size, restart counts that let a crashing run hold its machines forever).
Every numeric field a member may set is now bounded: by a project quota, a hard member limit
(``webapp/runs/policy.py``), or a stated reason that its value costs nothing. The walk below reads
the spec's schema, so a field added later fails it until it is classified."""

from __future__ import annotations

import pytest

from tests.webapp.conftest import (  # noqa: F401 - fixtures
    alice,
    api,
    dataset_version,
    project,
    reward_version,
)

pytestmark = pytest.mark.django_db


def test_every_numeric_member_field_has_a_bound():
    from webapp.runs.policy import unbounded_member_fields

    assert unbounded_member_fields() == [], (
        "numeric member fields without a bound: give each a quota, a MEMBER_LIMITS entry or a "
        "COSTLESS_FIELDS reason in webapp/runs/policy.py (docs/security.md, 'Bounds on every "
        "costly field')")


def test_the_walk_finds_nested_and_new_fields(monkeypatch):
    """A numeric field another change adds (here: a stand-in in the agent section) is caught."""
    from training_core import spec_fields
    from webapp.runs import policy

    extra = {"path": "rollout.agent.new_cost", "kind": "number", "section": "rollout",
             "name": "new_cost", "default": 1.0, "description": "", "nullable": False}
    real = spec_fields.spec_fields
    monkeypatch.setattr(spec_fields, "spec_fields", lambda: [*real(), extra])
    assert policy.unbounded_member_fields() == ["rollout.agent.new_cost"]


def test_fields_inside_an_optional_section_are_walked_too(monkeypatch):
    """model.lora is empty by default (full fine-tuning), so its fields are not in the form's
    list; the walk still finds them: without model.lora.rank's limit it would be unbounded."""
    from webapp.runs import policy

    monkeypatch.delitem(policy.MEMBER_LIMITS, "model.lora.rank")
    assert policy.unbounded_member_fields() == ["model.lora.rank"]
    assert policy.member_limit_errors({"model": {"lora": None}}) == []


def test_every_limit_names_a_real_field_and_the_defaults_are_within():
    from training_core.config import RunSpec
    from training_core.spec_fields import optional_section_fields, spec_fields
    from webapp.runs.policy import COSTLESS_FIELDS, MEMBER_LIMITS, member_limit_errors

    paths = {f["path"] for f in [*spec_fields(), *optional_section_fields()]}
    assert [p for p in MEMBER_LIMITS if p not in paths] == []
    assert [p for p in COSTLESS_FIELDS if not p.endswith(".*") and p not in paths] == []
    assert member_limit_errors(RunSpec().model_dump(mode="json")) == []


def _create(api, project, dataset_version, reward_version, spec):  # noqa: F811
    return api.post("/api/runs/", {"project": project.id, "name": "m", "spec": spec,
                                   "dataset_version": dataset_version.id,
                                   "reward_version": reward_version.id}, format="json")


@pytest.mark.parametrize("spec,field,maximum", [
    ({"reward": {"memory_mb": 262_144}}, "spec.reward.memory_mb", 8192),
    ({"rollout": {"agent": {"memory_mb": 65_536}}}, "spec.rollout.agent.memory_mb", 8192),
    ({"rollout": {"agent": {"timeout_s": 86_400}}}, "spec.rollout.agent.timeout_s", 1800),
    ({"rollout": {"agent": {"max_tokens": 10**7}}}, "spec.rollout.agent.max_tokens", 32_768),
    ({"rollout": {"group_size": 10_000}}, "spec.rollout.group_size", 64),
    ({"trainer": {"threads": 512}}, "spec.trainer.threads", 16),
    ({"rollout": {"max_batch_size": 10**6}}, "spec.rollout.max_batch_size", 1024),
    ({"checkpoint": {"keep": 10_000}}, "spec.checkpoint.keep", 10),
    ({"eval": {"size": 10**7}}, "spec.eval.size", 10_000),
    ({"orchestration": {"max_restarts": 10**6}}, "spec.orchestration.max_restarts", 3),
    ({"orchestration": {"max_server_restarts": 10**6}}, "spec.orchestration.max_server_restarts", 5),
    ({"model": {"warm_start_seconds": 10**9}}, "spec.model.warm_start_seconds", 3600),
    ({"model": {"lora": {"rank": 4096}}}, "spec.model.lora.rank", 256),  # an optional section
])
def test_a_member_over_a_limit_gets_a_403_naming_the_field(
        api, project, dataset_version, reward_version, spec, field, maximum):  # noqa: F811
    from webapp.runs.models import Run

    r = _create(api, project, dataset_version, reward_version, spec)
    assert r.status_code == 403, r.content
    (error,) = r.json()["errors"]
    assert error["field"] == field and error["maximum"] == maximum
    assert f"{maximum:,}" in error["message"] and not Run.objects.exists()


def test_the_spec_check_and_the_form_show_the_limits(api, alice):  # noqa: F811
    r = api.post("/api/runs/spec-check/", {"spec": {"reward": {"memory_mb": 262_144}}},
                 format="json")
    assert r.status_code == 200 and r.json()["valid"] is False
    assert r.json()["errors"][0]["field"] == "spec.reward.memory_mb"
    fields = {f["path"]: f for f in api.get("/api/runs/spec-schema/").json()["fields"]}
    assert fields["reward.memory_mb"]["maximum"] == 8192


def test_administrators_are_not_held_to_member_limits(api, alice, project, dataset_version,  # noqa: F811
                                                      reward_version):  # noqa: F811
    alice.is_staff = True
    alice.save()
    r = _create(api, project, dataset_version, reward_version, {"reward": {"memory_mb": 16_384}})
    assert r.status_code == 201, r.content


def test_a_member_may_train_an_adapter_within_the_rank_limit(api, project, dataset_version,  # noqa: F811
                                                             reward_version):  # noqa: F811
    r = _create(api, project, dataset_version, reward_version,
                {"model": {"lora": {"rank": 256, "target_modules": ["q_proj", "v_proj"]}}})
    assert r.status_code == 201, r.content
    # a bad adapter field is a 400 naming it
    r = api.post("/api/runs/spec-check/", {"spec": {"model": {"lora": {"rank": 0}}}},
                 format="json")
    assert r.status_code == 200 and r.json()["valid"] is False
    assert r.json()["errors"][0]["field"] == "spec.model.lora.rank"
