"""What a 5-turn agent costs per turn with and without the embedded server's prefix cache.

One agent conversation (the real ``openai`` package through the gateway: a system and a user
message, then the answer sent back and one more user message per turn, 16 tokens sampled per
turn, EOS ignored so every round samples the same lengths) against one embedded server. Rounds
alternate two modes on the same server: ``cached`` (as it runs: the session sticks to the
server and its prefix cache holds the conversation so far) and ``flushed`` (``/flush_cache``
before every turn: each turn prefills its whole prompt, as before the cache existed). Per turn:
prompt tokens, tokens the server's prefill computed (``/server_info`` ``prefill_tokens``), tokens
it took from the cache, and the turn's wall time; medians over rounds and the ratios
cached / flushed.

    python benchmarks/agent_turns.py --rounds 5 --out benchmarks/results/agent_turns.json
    python benchmarks/agent_turns.py --model smollm2 --rounds 3
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

TURNS = 5


def report(rounds: dict[str, list[list[dict]]], config: dict) -> dict:
    """Medians per mode and turn, and cached / flushed per turn. ``rounds[mode]`` is a list of
    rounds, each a list of turns ``{"prompt_tokens", "prefill_tokens", "cached_tokens",
    "new_tokens", "wall_s"}``."""
    out: dict = {"benchmark": "agent_turns", **config, "turns": TURNS, "modes": {}}
    for mode, runs in rounds.items():
        per_turn = []
        for t in range(TURNS):
            cell = [r[t] for r in runs]
            per_turn.append({k: statistics.median(c[k] for c in cell)
                             for k in ("prompt_tokens", "prefill_tokens", "cached_tokens",
                                       "new_tokens", "wall_s")})
        out["modes"][mode] = {"rounds": len(runs), "per_turn": per_turn}
    if {"cached", "flushed"} <= rounds.keys():
        cached, flushed = out["modes"]["cached"]["per_turn"], out["modes"]["flushed"]["per_turn"]
        out["ratio_cached_over_flushed"] = [
            {"prefill_tokens": c["prefill_tokens"] / f["prefill_tokens"],
             "wall_s": c["wall_s"] / f["wall_s"]} for c, f in zip(cached, flushed, strict=True)]
        last = cached[-1]
        out["fifth_turn"] = {"new_tokens": last["new_tokens"],
                             "prefill_tokens_cached": last["prefill_tokens"],
                             "prefill_tokens_flushed": flushed[-1]["prefill_tokens"],
                             "only_new_tokens_prefilled": last["prefill_tokens"] == last["new_tokens"]}
    return out


def one_round(gw, url: str, flush: bool) -> list[dict]:
    import httpx
    import openai

    session = gw.open()
    sdk = openai.OpenAI(base_url=f"{gw.url}/sessions/{session.id}/v1", api_key=session.key,
                        max_retries=0)
    messages = [{"role": "system", "content": "You add numbers."},
                {"role": "user", "content": "What is 12+30?"}]
    turns, previous = [], 0
    try:
        for _ in range(TURNS):
            if flush:
                httpx.post(url + "/flush_cache", timeout=30).raise_for_status()
            before = httpx.get(url + "/server_info", timeout=30).json()
            start = time.perf_counter()
            out = sdk.chat.completions.create(model="m", messages=messages)
            wall = time.perf_counter() - start
            after = httpx.get(url + "/server_info", timeout=30).json()
            prompt = out.usage.prompt_tokens
            turns.append({"prompt_tokens": prompt, "wall_s": wall,
                          "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
                          "cached_tokens": after["cached_tokens"] - before["cached_tokens"],
                          # what no earlier request computed: the last answer's last token (never
                          # fed to the model) and the new messages
                          "new_tokens": prompt - previous + (1 if previous else 0)})
            previous = prompt + out.usage.completion_tokens
            messages += [out.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "And add 7?"}]
    finally:
        sdk.close()
    return turns


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="bench-results/agent_turns.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from tests.training_core.conftest import start_server
    from tests.training_core.gateway_harness import GatewayThread
    from training_core.api import SamplingParams
    from training_core.models.loading import load_tokenizer
    from training_core.models.paths import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    fleet, url = start_server(model_dir, Path("/tmp/agent-turns-bench-server.log"))
    gw = GatewayThread(url, load_tokenizer(model_dir),
                       SamplingParams(max_new_tokens=args.tokens, ignore_eos=True))
    rounds: dict[str, list] = {"cached": [], "flushed": []}
    try:
        one_round(gw, url, flush=False)  # warm-up: kernels, allocator
        for _ in range(args.rounds):
            for mode in ("flushed", "cached"):
                rounds[mode].append(one_round(gw, url, flush=mode == "flushed"))
    finally:
        gw.close()
        fleet.stop()
    result = report(rounds, {"model": args.model, "tokens_per_turn": args.tokens,
                             "threads": args.threads,
                             "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
