"""Online mode: a client outside the platform (its own process, the openai package and httpx)
opens sessions with the run key, calls completions and posts rewards; the run trains on them."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from training_core.config import load_spec
from training_core.train import train

ISSUED_KEY = "issued-by-the-web-app-0123456789abcdef"


@pytest.mark.slow
def test_online_mode_trains_on_an_external_client(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    gateway_file = run_dir / "gateway.json"
    log = (tmp_path / "client.log").open("w")
    client = subprocess.Popen([sys.executable, "examples/online_client.py", str(gateway_file)],
                              stdout=log, stderr=subprocess.STDOUT)
    seen: dict = {}

    def check_gateway(step, metrics):  # while the run is up: the key is required
        if not seen:
            info = json.loads(gateway_file.read_text())
            seen["mode"] = gateway_file.stat().st_mode & 0o777
            bad = httpx.post(info["url"] + "/rl/sessions", json={},
                             headers={"Authorization": "Bearer wrong"})
            seen["bad"] = (bad.status_code, bad.json()["error"]["param"])

    spec = load_spec(None, [
        f"run_dir={run_dir}", "rollout.mode=online", "rollout.group_size=2",
        "rollout.max_new_tokens=6", "rollout.max_concurrent=2", "trainer.batch_groups=1",
        "trainer.steps=3", "eval.every=0", "checkpoint.every=0", "reward.executor=inline",
        "rollout.agent.timeout_s=120", f"rollout.agent.gateway_key={ISSUED_KEY}"])
    from training_core.run_setup import make_sinks

    sink = make_sinks(spec, run_dir)
    original = sink.log

    def log_and_check(step, metrics):
        check_gateway(step, metrics)
        original(step, metrics)

    sink.log = log_and_check
    try:
        train(spec, progress=False, sink=sink)
    finally:
        client.wait(timeout=60)
        log.close()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert len(rows) == 3 and all(r["agent/turns"] == 2 for r in rows)
    assert all(r["rollout/episode_errors"] == 0 for r in rows)
    assert seen == {"mode": 0o600, "bad": (401, "api_key")}
    events = [json.loads(line) for line in (run_dir / "events.jsonl").open()]
    (gateway,) = [e for e in events if e["kind"] == "gateway"]
    assert gateway["url"] == json.loads(gateway_file.read_text())["url"]
    assert json.loads(gateway_file.read_text())["run_key"] not in (run_dir / "events.jsonl").read_text()
    # The gateway takes the key the web app issued (rollout.agent.gateway_key), so the key its
    # members see on the run page is the one it accepts.
    assert json.loads(gateway_file.read_text())["run_key"] == ISSUED_KEY
    out = (tmp_path / "client.log").read_text()
    assert out.count("done") >= 3 and "gateway closed" in out
