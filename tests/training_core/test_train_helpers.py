"""The rollout side of the per-step profile, against real HTTP servers, through the rollout
client's transport."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from training_core.rollout_profile import RolloutProfile
from training_core.transport.rollout_client import RolloutClient


def _serve(payloads: list[dict], answer_after: threading.Event | None = None
           ) -> tuple[ThreadingHTTPServer, list[int]]:
    """A real server answering GETs with ``payloads`` in turn (then the last one again); with
    ``answer_after``, each answer waits for that event."""
    calls = [0]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if answer_after is not None:
                answer_after.wait(timeout=60)
            body = json.dumps(payloads[min(calls[0], len(payloads) - 1)]).encode()
            calls[0] += 1
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, calls


def test_profile_reads_embedded_counters_and_stops_asking_other_servers():
    embedded, _ = _serve([{"busy_s": 1.0, "prefill_s": 0.5, "tokens_generated": 100, "steps": 10},
                          {"busy_s": 1.0 + 1e6, "prefill_s": 0.5 + 1e6, "tokens_generated": 400,
                           "steps": 20}])
    sglang, sglang_calls = _serve([{"version": "0.5.4", "#queue-req": 0}])  # no counters
    try:
        urls = [f"http://127.0.0.1:{s.server_port}" for s in (embedded, sglang)]
        profile = RolloutProfile(RolloutClient(urls))
        assert profile.sample() == {}  # starts the baseline measurement
        profile._pending.result(timeout=30)  # a step's time passes
        assert profile.sample() == {}  # the baseline read; the next measurement started
        profile._pending.result(timeout=30)
        out = profile.sample()
        assert out["rollout/decode_batch_mean"] == 30  # 300 tokens over 10 decode steps
        assert out["rollout/server_busy_frac"] == 1.0  # capped at 1
        assert out["rollout/server_prefill_frac"] == 1.0
        assert out["rollout/tokens_per_s_per_server"] > 0
        assert sglang_calls[0] == 1 and profile.urls == urls[:1]  # asked once, then dropped
    finally:
        profile.close()
        embedded.shutdown()
        sglang.shutdown()


def test_profile_never_makes_a_step_wait_for_a_slow_server():
    """A server busy decoding answers /server_info late; the step goes on without it."""
    answered = threading.Event()

    server, _ = _serve([{"busy_s": 1.0, "tokens_generated": 1, "steps": 1}], answered)
    profile = RolloutProfile(RolloutClient([f"http://127.0.0.1:{server.server_port}"]))
    try:
        # The server has not answered: each step gets nothing instead of waiting for it.
        assert [profile.sample() for _ in range(3)] == [{}, {}, {}]
        assert not profile._pending.done()
    finally:
        answered.set()
        profile.close()
        server.shutdown()
