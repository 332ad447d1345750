"""Browser tests: Playwright driving Debian's Chromium against the live web app.

Screenshots land in test-artifacts/ (kept by CI as test artifacts)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.webapp.conftest import QA_ROWS, jsonl

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium is not installed"),
]
# Playwright's sync API runs an event loop in this thread; the ORM calls in the test are plain
# synchronous setup code.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


def browser_page(*, bypass_csp: bool):
    """A Chromium page. Playwright's ``wait_for_function`` evaluates its predicate with ``eval``,
    which the app's Content-Security-Policy forbids: tests that poll that way bypass the policy,
    and tests/security/test_web_xss.py checks the pages under it."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        pg = browser.new_page(viewport={"width": 1400, "height": 1000}, bypass_csp=bypass_csp)
        yield pg
        browser.close()


@pytest.fixture
def page():
    yield from browser_page(bypass_csp=True)


def _login(page, base: str) -> None:
    page.goto(base + "/")
    assert "/accounts/login/" in page.url  # pages need a login
    page.fill("input[name=username]", "alice")
    page.fill("input[name=password]", "alice-pass-123")
    page.click("button[type=submit]")
    page.wait_for_url(base + "/")


def _metrics(run, steps: int, scale: float) -> None:
    from webapp.tracking.services import metrics_ingest

    keys = ["reward/mean", "eval/accuracy", "staleness/mean", "tokens_per_s", "loss", "version"]
    metrics_ingest(run=run, points=[{"key": k, "step": s, "value": scale * s / steps, "time": 1e9 + s}
                                    for s in range(1, steps + 1) for k in keys])


def test_login_upload_create_run_charts_and_compare(page, live_server, alice, project, reward_version, tmp_path):
    base = live_server.url
    _login(page, base)

    # A broken file: the error names the line and the field, nothing is stored.
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"question": "1+1="}\n')
    page.goto(base + "/datasets/")
    page.fill("input[name=name]", "broken")
    page.select_option("select[name=task]", "qa")
    page.set_input_files("input[name=file]", str(bad))
    page.click("form.card button[type=submit]")
    error = page.locator(".error-box")
    error.wait_for()
    assert "line 1" in error.inner_text() and "answer" in error.inner_text()
    page.screenshot(path=str(ARTIFACTS / "dataset-upload-error.png"), full_page=True)

    good = tmp_path / "adds.jsonl"
    good.write_bytes(jsonl(QA_ROWS))
    page.fill("input[name=name]", "adds")
    page.select_option("select[name=task]", "arithmetic")
    page.set_input_files("input[name=file]", str(good))
    page.click("form.card button[type=submit]")
    page.wait_for_url("**/datasets/*/")
    assert "0+1=" in page.locator("table.preview").inner_text()
    page.screenshot(path=str(ARTIFACTS / "dataset-detail.png"), full_page=True)

    # Compare two runs picked from the run list.
    from webapp.runs.services import run_create

    run = run_create(project=project, user=alice, name="browser-run",
                     dataset_version=_dataset(project), reward_version=reward_version,
                     spec={"trainer": {"steps": 3}})
    _metrics(run, 3000, 1.0)
    other = run_create(project=project, user=alice, name="browser-run-2",
                       dataset_version=run.dataset_version, reward_version=reward_version,
                       spec={"trainer": {"steps": 5, "lr": 0.01}})
    _metrics(other, 500, 0.5)
    page.goto(base + "/")
    page.check(f"tr[data-run='{run.id}'] input[name=ids]")
    page.check(f"tr[data-run='{other.id}'] input[name=ids]")
    page.click("text=Compare selected")
    page.wait_for_function("document.querySelectorAll('#charts .main-svg').length >= 3")
    differing = page.locator("tr.differs").all_inner_texts()
    assert any("trainer.lr" in row for row in differing)
    assert any("trainer.steps" in row for row in differing)
    names = page.evaluate("document.getElementById('chart-0').data.map(t => t.name)")
    assert "browser-run-2" in names and "browser-run" in names
    page.locator("#summary tbody tr").nth(1).wait_for()
    assert page.locator("#summary tbody tr").count() == 2
    page.screenshot(path=str(ARTIFACTS / "compare.png"), full_page=True)


def _dataset(project):
    from webapp.datasets.models import DatasetVersion

    return DatasetVersion.objects.filter(dataset__project=project).first()


def test_other_users_runs_are_invisible_in_the_browser(page, live_server, run, bob):
    from webapp.accounts.services import user_create  # noqa: F401 (bob fixture made the user)

    page.goto(live_server.url + "/accounts/login/")
    page.fill("input[name=username]", "bob")
    page.fill("input[name=password]", "bob-pass-123")
    page.click("button[type=submit]")
    page.wait_for_url(live_server.url + "/")
    assert "r1" not in page.locator("table.runs").inner_text()
    resp = page.goto(f"{live_server.url}/runs/{run.id}/")
    assert resp.status == 404


def test_reward_editor_refuses_bad_code_and_saves_good_code(page, live_server, alice, project):
    from webapp.rewards.models import RewardFunction

    _login(page, live_server.url)
    page.goto(live_server.url + "/rewards/")
    page.fill("input[name=name]", "mine")
    page.fill("textarea[name=source]", "def reward(completion, item):\n    return (\n")
    page.click("form.card button[type=submit]")
    assert "syntax error on line 2" in page.locator(".error-box").inner_text()
    assert not RewardFunction.objects.exists()
    # The editor keeps what was typed; fix it and save.
    page.fill("textarea[name=source]", "def reward(completion, item):\n    return 1.0\n")
    page.click("form.card button[type=submit]")
    page.wait_for_url("**/rewards/*/")
    assert "pending" in page.content()
    page.screenshot(path=str(ARTIFACTS / "reward-editor.png"), full_page=True)
    assert RewardFunction.objects.get().versions.get().source.startswith("def reward")

