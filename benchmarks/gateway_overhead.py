"""What the gateway costs per turn: one chat completion through the real ``openai`` package and
the gateway, against the same generation as a direct ``agenerate`` call, on one embedded server
with the tiny model (16 tokens, EOS ignored so both sides sample the same length). Alternating
rounds; ratio = gateway / direct median latency.

    python benchmarks/gateway_overhead.py --rounds 20 --out bench-results/gateway_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import openai  # noqa: E402

from tests.training_core.conftest import start_server  # noqa: E402
from tests.training_core.gateway_harness import GatewayThread  # noqa: E402
from training_core.api import GenerationRequest, SamplingParams  # noqa: E402
from training_core.models.loading import load_tokenizer  # noqa: E402
from training_core.models.paths import resolve_model_dir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--out", default="bench-results/gateway_overhead.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model_dir = resolve_model_dir("tiny")
    tok = load_tokenizer(model_dir)
    fleet, url = start_server(model_dir, Path("/tmp/gateway-bench-server.log"))
    sampling = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    gw = GatewayThread(url, tok, sampling)
    try:
        messages = [{"role": "user", "content": "What is 12+30?"}]
        prompt = gw.gateway.renderer.full(messages, None)
        client = gw.engine.client
        direct, gateway = [], []
        for _ in range(args.rounds):
            session = gw.open()
            sdk = openai.OpenAI(base_url=f"{gw.url}/sessions/{session.id}/v1",
                                api_key=session.key, max_retries=0)
            start = time.perf_counter()
            gw.call(client.agenerate(GenerationRequest(list(prompt), sampling)))
            direct.append(time.perf_counter() - start)
            start = time.perf_counter()
            out = sdk.chat.completions.create(model="m", messages=messages)
            gateway.append(time.perf_counter() - start)
            assert out.usage.completion_tokens == args.tokens
            sdk.close()
    finally:
        gw.close()
        fleet.stop()
    d, g = statistics.median(direct), statistics.median(gateway)
    result = {"benchmark": "gateway_overhead", "rounds": args.rounds, "tokens": args.tokens,
              "direct_median_s": round(d, 4), "gateway_median_s": round(g, 4),
              "overhead_ms": round((g - d) * 1000, 2), "ratio_gateway_over_direct": round(g / d, 3)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
