"""Stored XSS: whoever holds a run's ingest token writes event kinds and messages that every
member's browser shows on the run page. They must show as text and never run."""

from __future__ import annotations

import pytest

from tests.webapp.conftest import (  # noqa: F401 - fixtures
    alice,
    dataset_version,
    project,
    reward_version,
    run,
)
from tests.webapp.test_browser import CHROMIUM, _login, page  # noqa: F401 - the page fixture

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not __import__("pathlib").Path(CHROMIUM).exists(),
                       reason="Debian chromium is not installed"),
]

PAYLOAD = '<img src=x onerror="window.__xss=1"><script>window.__xss=2</script>'


def test_event_kind_and_message_render_as_text(page, live_server, run):  # noqa: F811
    from webapp.runs.services import run_event_add

    run_event_add(run=run, kind="<i onclick=x>status</i>", message=PAYLOAD)  # kind: 30 chars max
    base = live_server.url
    _login(page, base)
    page.goto(f"{base}/runs/{run.id}/")
    # The live page rebuilds the list from the API (the code that interpolated before).
    page.wait_for_function("document.getElementById('events').textContent.includes('onerror')")
    page.wait_for_timeout(300)  # let an injected handler fire if there were one
    assert page.evaluate("window.__xss") is None
    assert page.locator("#events img, #events script, #events i").count() == 0
    text = page.locator("#events").inner_text()
    assert PAYLOAD in text and "<i onclick=x>status</i>" in text
