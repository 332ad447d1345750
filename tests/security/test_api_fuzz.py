"""API fuzzing with schemathesis against the schema the server itself serves (/api/schema/),
once as a project member (user token) over the user endpoints and once with a run's ingest token
over the ingest endpoints: no 5xx, and every answer conforms to the schema (status codes,
bodies, content types)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

from tests.webapp.conftest import (  # noqa: F401 - fixtures
    alice,
    dataset_version,
    project,
    reward_version,
    run,
)

pytestmark = [pytest.mark.django_db, pytest.mark.slow]
# Every default check but two, both about what the server accepts rather than what it answers:
# - positive_data_acceptance: schema-valid input can break a rule beyond the schema (a run spec is
#   validated by RunSpec, a password may be wrong, a project id may be someone else's): those are
#   documented 400s and 404s;
# - negative_data_rejection: DRF coerces by design ("12" for an integer, 12 for a text field,
#   surrounding whitespace trimmed); the bounds that matter (64-bit ids, sizes, NUL) have their
#   own tests in test_bad_input.py. Invalid input is still sent: it must never be a 5xx, and the
#   answer must conform to the schema.
FUZZ = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture
def api_schema(db):
    """The schema as the WSGI application serves it. Like Django's test client, requests here
    keep the test's database connection (a real request closes it when it finishes)."""
    from django.core.signals import request_finished, request_started
    from django.core.wsgi import get_wsgi_application
    from django.db import close_old_connections

    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield schemathesis.openapi.from_wsgi("/api/schema/", get_wsgi_application())
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.fixture
def member_token(alice, run) -> str:  # noqa: F811 - a project with a dataset, reward and run
    from webapp.accounts.services import token_get_or_create

    return token_get_or_create(user=alice)


@pytest.fixture
def ingest_token(run) -> str:  # noqa: F811
    from webapp.runs.services import run_token_issue

    return run_token_issue(run=run, purpose="fuzz")


@pytest.fixture(autouse=True)
def _no_throttle_carry_over():
    from django.core.cache import cache

    cache.clear()


def _fuzz(schema, headers: dict[str, str]) -> list[str]:
    """Every operation's generated cases, valid ones and ones that break the schema (the server
    must refuse those with a 4xx), through every default check; the failures, named."""
    failures, operations = [], 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1

        @FUZZ
        @given(case=st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                              operation.as_strategy(GenerationMode.NEGATIVE)))
        def fuzz(case):
            case.call_and_validate(headers=headers, excluded_checks=[positive_data_acceptance,
                                                                negative_data_rejection])

        try:
            fuzz()
        except Exception as exc:  # the check's report: which operation, which case, why
            failures.append(f"{operation.label}: {str(exc)[:3000]}")
    assert operations, "the schema has no operations"
    return failures


@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_user_endpoints_as_a_member(api_schema, member_token, settings, debug):
    # DEBUG changes what Django answers for unmatched URLs and errors: both must hold.
    settings.DEBUG = debug
    failures = _fuzz(api_schema.exclude(path_regex="^/api/ingest/"),
                     {"Authorization": f"Token {member_token}"})
    assert not failures, "\n\n".join(failures)


def test_ingest_endpoints_with_a_run_token(api_schema, ingest_token):
    failures = _fuzz(api_schema.include(path_regex="^/api/ingest/"),
                     {"Authorization": f"Bearer {ingest_token}"})
    assert not failures, "\n\n".join(failures)


def test_the_schema_documents_every_operation(api_schema):
    """Request bodies, parameters, error codes and both security schemes are in the schema."""
    raw = api_schema.raw_schema
    schemes = raw["components"]["securitySchemes"]
    assert {"tokenAuth", "runIngestToken"} <= set(schemes)
    for path, item in raw["paths"].items():
        for method, op in item.items():
            codes = set(op["responses"])
            assert codes - {"200", "201", "202"}, f"{method} {path} documents no error code"
            if method == "post" and "cancel" not in path and "resume" not in path:
                assert "requestBody" in op, f"{method} {path} has no request body"
            if path.startswith("/api/ingest/"):
                assert op["security"] == [{"runIngestToken": []}], (path, op["security"])
                # every ingest endpoint is throttled per run token: its 429 is documented
                assert "429" in codes, f"{method} {path} does not document its 429"
    started = raw["components"]["schemas"]["RunOutput"]["properties"]["started_at"]
    assert started.get("nullable") is True
