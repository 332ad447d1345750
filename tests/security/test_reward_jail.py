"""Attacks by reward code, run the way a training run runs rewards (the trainer's reward pool,
code loaded from a file on the path like the web app's user rewards): each one is contained and
reported, the pool keeps scoring, and no secret of the host reaches what is stored."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from training_core.rewards.pool import RewardPool

SECRET = "oolong-test-secret-4f1c9e"

ATTACKS = {
    "environ": ("import os\ndef reward(c, i):\n"
                "    found = [open(f'/proc/{p}/environ').read() for p in os.listdir('/proc')\n"
                "             if p.isdigit() and os.access(f'/proc/{p}/environ', os.R_OK)]\n"
                "    raise RuntimeError(repr(dict(os.environ)) + repr(found))\n"),
    "raw_socket": ("import _socket\ndef reward(c, i):\n"
                   "    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
                   "    s.connect(('127.0.0.1', 6379))\n    s.send(b'PING\\r\\n')\n"
                   "    raise RuntimeError('reached redis: ' + repr(s.recv(100)))\n"),
    "fork_setsid": ("import os, time\ndef reward(c, i):\n    if os.fork() == 0:\n"
                    "        os.setsid()\n        time.sleep(3600)\n    time.sleep(3600)\n"),
    "stdout_flood": ("import os, sys\ndef reward(c, i):\n    sys.stdout.write('x' * 50_000_000)\n"
                     "    os.write(3, b'{' * 5_000_000)\n    return 1.0\n"),
    "read_host_files": ("import os\ndef reward(c, i):\n"
                        "    seen = {p: os.path.exists(p) for p in ('/etc/passwd', i['victim'])}\n"
                        "    raise RuntimeError(repr(seen) + open(i['victim']).read())\n"),
    "allocate_10gb": "def reward(c, i):\n    x = bytearray(10 * 2**30)\n    return 1.0\n",
}


@pytest.fixture
def attack_module(tmp_path, monkeypatch):
    """Writes reward code as an importable-looking module, as remote_run does for user rewards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DATABASE_URL", f"postgres://admin:{SECRET}@127.0.0.1/prod")

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(source)
        return f"{name}:reward"

    return write


def _score(path: str, n: int = 1, timeout_s: float = 3.0, item: dict | None = None):
    async def go():
        pool = RewardPool(path, workers=1, timeout_s=timeout_s)
        try:
            return [await pool.score("42", {"answer": "42", **(item or {})}) for _ in range(n)]
        finally:
            pool.close()

    return asyncio.run(go())


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_is_contained_and_reported(name, attack_module, tmp_path):
    # Another run's directory on the same host, with its token in the spec.
    victim = tmp_path / "other-run" / "spec.yaml"
    victim.parent.mkdir()
    victim.write_text(f"metrics:\n  tracker_token: {SECRET}\n")
    results = _score(attack_module(f"attack_{name}", ATTACKS[name]), n=2,
                     item={"victim": str(victim)})
    for result in results:
        assert result.reward == 0.0 and result.error, result
        assert SECRET not in result.error  # nothing of the host's environment leaks
        assert "reached redis" not in result.error
        assert len(result.error) <= 600
    if name == "read_host_files":
        assert "FileNotFoundError" in results[0].error  # the other run's files are not there
    # The jailed processes are gone (killed on timeout, forked children included).
    left = subprocess.run(["pgrep", "-f", "time.sleep\\(3600\\)|oolong-jail"], capture_output=True,
                          text=True).stdout.split()
    assert str(os.getpid()) not in left and not [p for p in left if p != str(os.getpid())]


def test_the_pool_keeps_scoring_after_an_attack(attack_module):
    path = attack_module("sometimes_bad", "import time\ndef reward(c, i):\n"
                         "    if i.get('bad'):\n        time.sleep(3600)\n"
                         "    return float(c == i['answer'])\n")

    async def go():
        pool = RewardPool(path, workers=1, timeout_s=1.0)
        try:
            bad = await pool.score("1", {"answer": "1", "bad": True})
            good = await pool.score("1", {"answer": "1"})
            return bad, good
        finally:
            pool.close()

    bad, good = asyncio.run(go())
    assert bad.reward == 0.0 and "timed out" in bad.error
    assert good.reward == 1.0 and good.error is None


def test_the_trainer_never_imports_reward_code(attack_module):
    """Loading the pool reads the module's source; it never runs it in the trainer."""
    marker = attack_module("import_side_effect", "import os\nos.environ['IMPORTED_HERE'] = '1'\n"
                           "def reward(c, i):\n    return 1.0\n")
    results = _score(marker)
    assert results[0].reward == 1.0 and "IMPORTED_HERE" not in os.environ
    assert "import_side_effect" not in sys.modules


def test_without_bwrap_reward_code_does_not_run(attack_module, monkeypatch):
    from training_core.jail import argv
    from training_core.sandbox import SandboxUnavailable

    monkeypatch.setattr(argv.shutil, "which", lambda name: None)
    argv.bwrap_path.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
            _score(attack_module("plain", "def reward(c, i):\n    return 1.0\n"))
    finally:
        argv.bwrap_path.cache_clear()


@pytest.mark.slow
def test_a_whole_run_cannot_see_the_hosts_secrets(attack_module, tmp_path):
    """Through a real training run (embedded server, trainer, reward pool) a reward that looks
    for the host's secret everywhere it can read (its environment, every /proc/*/environ, the
    parent's command line) finds nothing: every reward is 0 and none failed. With the old
    unjailed pool the secret was in the worker's inherited environment: reward 1."""
    from tests.training_core.test_train_e2e import SMALL
    from training_core.config import load_spec
    from training_core.metrics import read_metrics
    from training_core.train import train

    path = attack_module("sees_secret", (
        "import os\ndef reward(c, i):\n"
        "    seen = repr(dict(os.environ))\n"
        "    for p in os.listdir('/proc'):\n"
        "        for f in ('environ', 'cmdline'):\n"
        "            try:\n                seen += open(f'/proc/{p}/{f}').read()\n"
        "            except OSError:\n                pass\n"
        f"    return 1.0 if {SECRET!r} in seen else 0.0\n"))
    spec = load_spec(None, [o for o in SMALL if not o.startswith("reward.fn")] + [
        f"run_dir={tmp_path / 'run'}", f"reward.fn={path}", "trainer.steps=2",
        "checkpoint.every=0", "eval.every=0"])
    result = train(spec, progress=False)
    steps = [r for r in read_metrics(result.run_dir) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["reward/errors"] == 0 and r["reward/mean"] == 0.0 for r in steps), steps
