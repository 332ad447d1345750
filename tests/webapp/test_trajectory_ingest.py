"""Trajectory ingest writes one statement over one JSON document on PostgreSQL: what a reader gets
back must be exactly what the trainer sent, a retry must change nothing, and a bad field must
still be a 400 naming it."""

import pytest

from webapp.core.errors import ApplicationError
from webapp.tracking.models import TrajectorySample
from webapp.tracking.services import trajectories_ingest

pytestmark = pytest.mark.django_db


def _sample(step: int, index: int, **extra) -> dict:
    return {"step": step, "index": index, "prompt": f"What is {step} + {index}? ",
            "completion": "It is \"42\" — ünïcödé, tab\there, back\\slash {[<>]}",
            "reward": 0.1 + 1e-17 * index, "tokens": ["It", " is", " \"42\"", "\n", "\\"],
            "token_versions": [step // 4, step // 4, -1, 2**40, 0],
            "info": {"extracted": "42", "nested": {"list": [1, 2.5, None, True, "x"]}}, **extra}


def test_samples_round_trip_exactly_and_a_retry_changes_nothing(run):
    samples = [_sample(s, i) for s in (3, 2**62) for i in range(3)]
    assert trajectories_ingest(run=run, samples=samples) == 6
    changed = [{**s, "reward": 9.0, "completion": "other"} for s in samples]
    assert trajectories_ingest(run=run, samples=changed) == 6  # received; the stored stay
    stored = {(t.step, t.index): t for t in TrajectorySample.objects.filter(run=run)}
    assert len(stored) == 6
    for s in samples:
        t = stored[(s["step"], s["index"])]
        assert (t.prompt, t.completion, t.reward, t.tokens, t.token_versions, t.info) == (
            s["prompt"], s["completion"], s["reward"], s["tokens"], s["token_versions"], s["info"])


def test_index_defaults_to_the_position_and_values_are_coerced_as_before(run):
    trajectories_ingest(run=run, samples=[
        {"step": 1, "prompt": 7, "completion": "c", "reward": "0.5"},
        {"step": 1, "prompt": "p", "completion": "c", "reward": True}])
    rows = list(TrajectorySample.objects.filter(run=run).values_list(
        "index", "prompt", "reward", "tokens", "token_versions", "info"))
    assert rows == [(0, "7", 0.5, [], [], {}), (1, "p", 1.0, [], [], {})]


@pytest.mark.parametrize("bad,field", [
    ({"tokens": ["a", "b\x00"]}, "samples[1].tokens[1]"),
    ({"info": {"k\x00": 1}}, "samples[1].info"),
    ({"reward": float("inf")}, "samples[1].reward"),
    ({"info": {"t": [1.0, float("nan")]}}, "samples[1].info.t[1]"),
])
def test_a_bad_field_is_named_and_nothing_of_the_batch_is_stored(run, bad, field):
    with pytest.raises(ApplicationError) as exc:
        trajectories_ingest(run=run, samples=[_sample(1, 0), {**_sample(1, 1), **bad}])
    assert exc.value.errors[0]["field"] == field
    assert not TrajectorySample.objects.filter(run=run).exists()


def test_a_literal_backslash_u0000_is_text_not_a_nul(run):
    """The fast check looks for the encoder's escape of NUL; a prompt that spells it out is not
    one and is stored as written."""
    trajectories_ingest(run=run, samples=[_sample(1, 0, prompt="say \\u0000 please")])
    assert TrajectorySample.objects.get(run=run).prompt == "say \\u0000 please"


def test_nesting_deeper_than_the_limit_is_named(run):
    deep: dict = {}
    node = deep
    for _ in range(40):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(ApplicationError) as exc:
        trajectories_ingest(run=run, samples=[_sample(1, 0, info=deep)])
    assert exc.value.errors[0]["field"].startswith("samples[0].info.x")


@pytest.mark.parametrize("sample", [
    {"step": 1, "prompt": "\ud800", "completion": "c", "reward": 1},
    {"step": 1, "prompt": "p", "completion": "c", "reward": 1, "info": {"\udfff": 1}},
])
def test_a_lone_surrogate_is_a_400_not_a_500(run, ingest_token, sample):
    """JSON may spell a lone UTF-16 surrogate (\\ud800); no database text can hold one."""
    import json

    from rest_framework.test import APIClient

    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Bearer {ingest_token}")
    body = json.dumps({"samples": [sample]})  # ASCII: the surrogate travels as an escape
    resp = c.post("/api/ingest/trajectories/", body, content_type="application/json")
    assert resp.status_code == 400, resp.content
    assert not TrajectorySample.objects.filter(run=run).exists()
