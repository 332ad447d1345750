"""Server-rendered pages without a browser: forms parse the input (tests/webapp/test_browser.py
drives the same pages in Chromium)."""

import pytest

pytestmark = pytest.mark.django_db


def test_forms_name_the_bad_field_and_refuse_yaml_aliases(alice):
    """Server-rendered forms: a bad value is reported by field, nothing is stored, and a YAML
    alias bomb in the spec box is refused before it expands."""
    from django.test import Client

    from webapp.runs.models import Run

    client = Client()
    client.force_login(alice)
    bad = client.post("/runs/new/", {"project": "x", "dataset_version": "1", "reward_version": "1"})
    assert bad.status_code == 200 and b"<code>project</code>" in bad.content
    bomb = "a: &a [x, x]\nb: &b [*a, *a]\nc: [*b, *b]\n"
    resp = client.post("/runs/new/", {"project": "1", "dataset_version": "1", "reward_version": "1",
                                      "spec": bomb})
    assert b"aliases" in resp.content and not Run.objects.exists()
    compare = client.get("/compare/", {"id_list": "1,abc"})
    assert compare.status_code == 200 and b"run ids are numbers" in compare.content
