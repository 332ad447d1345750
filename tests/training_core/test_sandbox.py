"""The reward sandbox on its own: limits, isolation, reporting."""

import pytest

from training_core.sandbox import run_sandboxed

ROWS = [{"question": "1+1=", "answer": "2", "completion": "2"},
        {"question": "1+1=", "answer": "2", "completion": "3"}]
GOOD = "def reward(completion, item):\n    return float(completion.strip() == item['answer'])\n"


def test_cpu_time_limit_is_named():
    report = run_sandboxed("def reward(c, i):\n    while True:\n        pass\n", "reward", ROWS,
                           timeout_s=30, cpu_s=1)
    assert not report["ok"] and "CPU time limit (1s) exceeded" in report["error"], report


def test_good_code_scores_rows():
    report = run_sandboxed(GOOD, "reward", ROWS)
    assert report["ok"] and [r["reward"] for r in report["results"]] == [1.0, 0.0]


@pytest.mark.parametrize("source,fragment", [
    ("def reward(c, i):\n    while True:\n        pass\n", "timed out"),
    ("def reward(c, i):\n    x = bytearray(10 * 1024**3)\n    return 1.0\n", "MemoryError"),
    # The jail's network namespace has only its own loopback: the host's PostgreSQL is not there.
    ("import socket\ndef reward(c, i):\n    s = socket.create_connection(('127.0.0.1', 5432))\n    return 1.0\n",
     "ConnectionRefusedError: [Errno 111] Connection refused (the reward jail has no network)"),
    # Through urllib (ssl imported, as reasoning_gym does): the name does not even resolve.
    ("import urllib.request\ndef reward(c, i):\n    urllib.request.urlopen('https://pypi.org', timeout=2)\n    return 1.0\n",
     "URLError: <urlopen error [Errno -3] Temporary failure in name resolution> (the reward jail has no network)"),
    ("def reward(c, i):\n    return float('nan')\n", "returned nan"),
    ("import nonexistent_pkg\ndef reward(c, i):\n    return 1.0\n", "import failed"),
])
def test_bad_code_is_stopped_and_reported(source, fragment):
    report = run_sandboxed(source, "reward", ROWS, timeout_s=3)
    assert not report["ok"]
    assert fragment in report["error"], report


def test_network_namespace_is_used_when_available():
    code = ("import _socket\ndef reward(c, i):\n"
            "    s = _socket.socket()\n    return float(s.connect_ex(('127.0.0.1', 5432)))\n")
    report = run_sandboxed(code, "reward", ROWS[:1])
    if report["network_isolated"]:
        # Even bypassing the socket module, the namespace has no route to the host's services.
        assert report["results"][0]["reward"] != 0.0


def test_ordinary_concurrency_works_under_the_seccomp_filter():
    """The filter refuses namespaces, not processes: threads (glibc tries clone3, gets ENOSYS and
    falls back to clone), subprocesses and a multiprocessing pool all work in a reward."""
    source = ("import multiprocessing as mp, subprocess, threading\n"
              "def square(x):\n    return x * x\n"
              "def reward(c, i):\n"
              "    out = []\n"
              "    t = threading.Thread(target=lambda: out.append(1))\n"
              "    t.start(); t.join()\n"
              "    echoed = subprocess.run(['echo', 'hi'], capture_output=True, text=True).stdout\n"
              "    with mp.get_context('fork').Pool(2) as pool:\n"
              "        squares = sum(pool.map(square, [1, 2, 3]))\n"
              "    return float(len(out)) + (echoed.strip() == 'hi') + squares\n")
    report = run_sandboxed(source, "reward", ROWS[:1], timeout_s=60)
    assert report["ok"] and report["results"][0]["reward"] == 16.0, report


def test_a_jail_bwrap_refuses_to_build_names_bwraps_reason():
    from training_core.jail import Limits, SandboxUnavailable
    from training_core.sandbox import JailedWorker

    with pytest.raises(SandboxUnavailable, match="bwrap: --size takes a non-zero number"):
        JailedWorker({"kind": "source", "entrypoint": "reward"}, source=GOOD,
                     limits=Limits(tmpfs_mb=0))
