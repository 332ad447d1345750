"""The local engine's database is made once, whoever starts first (two runs of a sweep at once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


CALL = ("from orchestration.trigger import prefect_database_ready, prefect_env; "
        "print(prefect_database_ready(prefect_env()))")


@pytest.mark.slow  # one real Prefect migration (~10-30 s)
def test_two_first_starts_at_once_migrate_the_database_once(tmp_path):
    home = tmp_path / "prefect"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "platform")])}
    env.pop("PREFECT_API_URL", None)
    procs = [subprocess.Popen([sys.executable, "-c", CALL], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    # One of them made it; the other waited on the lock and found it done.
    assert sorted(out.strip() for out, _ in results) == ["False", "True"]
    assert (home / "prefect.db").stat().st_size > 0
    assert list(home.glob(".oolong-migrated-*"))


def test_flows_inherit_no_web_app_secret(monkeypatch):
    from orchestration.trigger import prefect_env

    secrets = {"DATABASE_URL": "postgres://u:p@db/x", "CELERY_BROKER_URL": "redis://r/0",
               "CELERY_RESULT_BACKEND": "redis://r/1", "DJANGO_SECRET_KEY": "k",
               "DJANGO_CACHE_URL": "redis://:password@cache/2"}
    for key, value in secrets.items():
        monkeypatch.setenv(key, value)
    # An allow-list: a secret nobody thought of (here a payment key) does not pass either.
    monkeypatch.setenv("STRIPE_API_KEY", "sk_live_x")
    monkeypatch.setenv("OOLONG_RUNS_DIR", "/runs")
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    monkeypatch.setenv("TF_CLI_CONFIG_FILE", "/etc/terraformrc")
    monkeypatch.setenv("AWS_PROFILE", "oolong")
    env = prefect_env()
    assert not (set(secrets) | {"STRIPE_API_KEY"}) & set(env)
    # what a flow needs: the platform's, Prefect's, Terraform's and the cloud's settings
    assert env["OOLONG_RUNS_DIR"] == "/runs"
    assert env["PREFECT_API_URL"] == "http://127.0.0.1:4200/api"
    assert env["TF_CLI_CONFIG_FILE"] == "/etc/terraformrc" and env["AWS_PROFILE"] == "oolong"
    assert env["PATH"] == os.environ["PATH"]


def test_server_mode_passes_the_flows_token_sealed_never_as_a_parameter(monkeypatch):
    """Prefect shows a flow run's parameters to every client (the nodes of every run): the
    token goes sealed with the control plane's key, which only the flows' worker opens."""
    import prefect.deployments
    from orchestration import trigger
    from orchestration.sealing import CONTROL_KEY_ENV, SealError, new_key

    sent = {}

    class _FlowRun:
        id = "f-1"

    def run_deployment(name, **kwargs):
        sent.update(kwargs)
        return _FlowRun()

    monkeypatch.setattr(prefect.deployments, "run_deployment", run_deployment)
    monkeypatch.setenv("OOLONG_PREFECT_MODE", "server")
    monkeypatch.delenv(CONTROL_KEY_ENV, raising=False)
    with pytest.raises(SealError, match="OOLONG_CONTROL_KEY is not set"):
        trigger.submit_training_run(run_id=4, tracker_url="https://web", ingest_token="tok-4-secret")
    monkeypatch.setenv(CONTROL_KEY_ENV, new_key())
    assert trigger.submit_training_run(run_id=4, tracker_url="https://web",
                                       ingest_token="tok-4-secret", provider="terraform") == "prefect:f-1"
    params = sent["parameters"]
    assert "tok-4-secret" not in repr(params) and "https://web" not in repr(params)
    assert set(params) == {"run_id", "provider", "resume", "sealed"}
    cred = trigger.flow_credential(4, sealed=params["sealed"])
    assert (cred.token, cred.tracker_url) == ("tok-4-secret", "https://web")
    with pytest.raises(SealError):  # another run's id with this seal
        trigger.flow_credential(5, sealed=params["sealed"])
    monkeypatch.setenv(CONTROL_KEY_ENV, new_key())  # a machine without the control plane's key
    with pytest.raises(SealError):
        trigger.flow_credential(4, sealed=params["sealed"])


def test_local_mode_takes_the_token_from_the_environment(monkeypatch):
    from orchestration import trigger

    monkeypatch.delenv(trigger.TOKEN_ENV, raising=False)
    with pytest.raises(RuntimeError, match="got no credential"):
        trigger.flow_credential(3, tracker_url="http://web")
    monkeypatch.setenv(trigger.TOKEN_ENV, "tok-3")
    assert trigger.flow_credential(3, tracker_url="http://web").token == "tok-3"
