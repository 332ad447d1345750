"""The supervise loop's server probe at scale: one poll of N lightweight rollout servers on
loopback (tests/orchestration/tiny_servers.py, SGLang's /model_info), each answering after
``--delay`` seconds, one of them hung. Asked one after another (``concurrency=1``, what the loop
did before) against all at once (``concurrency=64``), alternating rounds; ratio = sequential /
concurrent poll time, per N.

    python benchmarks/supervise_poll.py --quick --out bench-results/supervise_poll.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]

from orchestration.probe import probe  # noqa: E402


def measure(count: int, delay: float, timeout_s: float, rounds: int) -> dict:
    proc = subprocess.Popen([sys.executable, "-m", "tests.orchestration.tiny_servers", "--count",
                             str(count), "--delay", str(delay), "--hang", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        urls = json.loads(proc.stdout.readline())["urls"]
        seq, conc = [], []
        for _ in range(rounds):  # alternating: a busy moment hits both sides alike
            seq.append(probe(urls, timeout_s=timeout_s, concurrency=1).seconds)
            conc.append(probe(urls, timeout_s=timeout_s, concurrency=64).seconds)
    finally:
        proc.kill()
        proc.wait()
    s, c = statistics.median(seq), statistics.median(conc)
    return {"servers": count, "hung": 1, "delay_s": delay, "probe_timeout_s": timeout_s,
            "sequential_s": round(s, 3), "concurrent_s": round(c, 3),
            "bound_s": timeout_s, "ratio": round(s / c, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="bench-results/supervise_poll.json")
    args = parser.parse_args()
    counts = [8, 32] if args.quick else [8, 32, 64]
    rounds = 2 if args.quick else 3
    results = [measure(n, delay=0.02, timeout_s=1.0, rounds=rounds) for n in counts]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "supervise_poll", "results": results}, indent=2))
    for r in results:
        print(f"{r['servers']:3d} servers (1 hung): sequential {r['sequential_s']:.2f}s, "
              f"concurrent {r['concurrent_s']:.2f}s (bound {r['bound_s']:.1f}s), "
              f"ratio {r['ratio']}")


if __name__ == "__main__":
    main()
