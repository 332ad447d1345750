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
    ("import socket\ndef reward(c, i):\n    s = socket.create_connection(('127.0.0.1', 5432))\n    return 1.0\n",
     "network"),
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
