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
from tests.webapp.test_browser import CHROMIUM, _login, browser_page, page  # noqa: F401 - the page fixture

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


@pytest.fixture
def strict_page():
    yield from browser_page(bypass_csp=False)


def test_pages_run_under_the_content_security_policy(strict_page, live_server, run):  # noqa: F811
    """Every page is sent with a policy that allows only our own scripts; the run page's charts
    still draw under it (no inline script or eval of ours is blocked), and a script that an
    attacker gets into the DOM does not run."""
    from webapp.tracking.services import metrics_ingest

    metrics_ingest(run=run, points=[{"key": "reward/mean", "step": s, "value": s / 10}
                                    for s in range(5)])
    violations: list[str] = []
    strict_page.on("console", lambda m: violations.append(m.text)
                   if "Content Security Policy" in m.text else None)
    base = live_server.url
    _login(strict_page, base)
    response = strict_page.goto(f"{base}/runs/{run.id}/")
    policy = response.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "unsafe-eval" not in policy
    assert "frame-ancestors 'none'" in policy
    strict_page.locator("#chart-groups .js-plotly-plot").first.wait_for(timeout=20_000)
    strict_page.evaluate("""() => {
        const s = document.createElement("script");
        s.textContent = "window.__csp = 1";
        document.body.append(s);
        const img = document.createElement("img");
        img.setAttribute("onerror", "window.__csp = 2");
        img.src = "x";
        document.body.append(img);
    }""")
    strict_page.wait_for_timeout(300)
    assert strict_page.evaluate("window.__csp") is None
    assert any("inline" in v for v in violations)  # the browser refused the injected script
    ours = [v for v in violations if "__csp" not in v and "inline" not in v]
    assert not ours, ours
    for path in ("/", "/datasets/", "/rewards/", "/runs/new/", f"/runs/new/?clone={run.id}",
                 f"/compare/?ids={run.id}", "/sweeps/", "/api/docs/"):
        before = len(violations)
        strict_page.goto(base + path)
        strict_page.wait_for_load_state("networkidle")
        assert len(violations) == before, (path, violations[before:])


def test_run_names_and_config_values_show_as_text_in_comparisons(page, live_server, run, alice):  # noqa: F811
    """Run names and config values go into chart legends, parallel-coordinate ticks and the
    summary table: plotly reads some tags in its texts, so they must arrive escaped."""
    from webapp.runs.services import run_create
    from webapp.tracking.services import metrics_ingest

    name = '<a href="javascript:window.__xss=3">x</a><b>bold</b>'
    other = run_create(project=run.project, user=alice, name=name,
                       dataset_version=run.dataset_version, reward_version=run.reward_version,
                       spec={"data": {"prompt_template": "<b>{question}</b>",
                                      "options": {"<i>k</i>": 1}}})
    for r in (run, other):
        metrics_ingest(run=r, points=[{"key": "reward/mean", "step": s, "value": s / 10,
                                       "time": 1e9 + s} for s in range(1, 11)])
    _login(page, live_server.url)
    page.goto(f"{live_server.url}/compare/?ids={run.id},{other.id}")
    page.wait_for_selector("#parcoords .parcoords")
    page.wait_for_function("document.querySelectorAll('#summary tbody tr').length === 2")
    legend = page.locator("#chart-0 .legendtext").all_text_contents()
    assert name in legend, legend  # shown as typed, not as a link and bold text
    assert page.locator("#charts a, #charts b, #parcoords a, #parcoords b, #summary b").count() == 0
    assert name in page.locator("#summary").inner_text()
    ticks = " ".join(page.locator("#parcoords text").all_text_contents())
    assert "<b>{question}</b>" in ticks and "data.options.<i>k</i>" in ticks, ticks
    assert page.locator("#parcoords i").count() == 0
    assert page.evaluate("window.__xss") is None


def test_an_agents_turns_render_as_text_turn_by_turn(strict_page, live_server, run):  # noqa: F811
    """The trajectory viewer draws an agent's segment turn by turn (messages, tool calls, tool
    results, returns, versions); everything in it is the agent's or the model's output, so it is
    text: a tool result carrying markup shows as typed and runs nothing."""
    from webapp.tracking.services import trajectories_ingest

    hostile = '<img src=x onerror="window.__turns = 1">'
    turns = [
        {"turn": 0, "segment": 0, "new_messages": [{"role": "user", "content": "What is 17*23?"}],
         "completion": '<tool_call>{"name": "calc", "arguments": {"expr": "17*23"}}</tool_call>',
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "calc", "arguments": '{"expr": "17*23"}'}}],
         "finish_reason": "tool_calls", "versions": [3], "tool_parse_failed": False,
         "return": 0.9},
        {"turn": 1, "segment": 0,
         "new_messages": [{"role": "tool", "tool_call_id": "call_1", "content": "391 " + hostile}],
         "completion": "The answer is 391.", "tool_calls": [], "finish_reason": "stop",
         "versions": [3, 4], "tool_parse_failed": False, "return": 1.0}]
    trajectories_ingest(run=run, samples=[{
        "step": 1, "prompt": "agent", "completion": "The answer is 391.", "reward": 1.0,
        "tokens": ["The", " answer"], "token_versions": [3, 4],
        "info": {"turns": turns}}])
    _login(strict_page, live_server.url)
    strict_page.goto(f"{live_server.url}/runs/{run.id}/")
    items = strict_page.locator("#trajectories .turn")
    items.nth(1).wait_for(timeout=20_000)
    first, second = items.all_inner_texts()
    assert "turn 0" in first and "versions 3" in first and "→ calc(" in first
    assert "user: What is 17*23?" in first
    assert "turn 1" in second and "versions 3, 4" in second and "return 1.000" in second
    assert "tool result (call_1): 391 " + hostile in second  # the markup, as text
    assert strict_page.evaluate("window.__turns") is None
    assert strict_page.locator("#trajectories img").count() == 0
