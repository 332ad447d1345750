"""Protocol tests of the embedded rollout server over real HTTP (SGLang's native API)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from tests.training_core.conftest import generate
from training_core.api import GenerationRequest, SamplingParams
from training_core.models.loading import load_model
from training_core.prefix_tree import sequence_logprobs
from training_core.transport.rollout_client import RolloutClient


def test_health_and_model_info(server):
    assert httpx.get(server + "/health").status_code == 200
    info = httpx.get(server + "/model_info").json()
    assert info["is_generation"] is True and "weight_version" in info


def test_generate_returns_sglang_shaped_response(server):
    out = generate(server, [10, 11, 12], max_new_tokens=8, ignore_eos=True)
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 8
    assert meta["finish_reason"]["type"] == "length"
    assert len(meta["output_token_logprobs"]) == 8
    lp, tok, _ = meta["output_token_logprobs"][0]
    assert tok == out["output_ids"][0] and lp <= 0.0
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 8


def test_logprobs_come_only_when_asked_as_in_sglang(server):
    """SGLang's TokenizerManager adds output_token_logprobs only for return_logprob; the
    embedded server used to send them always, so a client that forgot to ask worked here and
    broke on SGLang. Per row in a batch, too."""
    body = {"input_ids": [10, 11, 12], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    plain = httpx.post(server + "/generate", json=body, timeout=60).json()
    assert "output_token_logprobs" not in plain["meta_info"] and len(plain["output_ids"]) == 4
    batch = httpx.post(server + "/generate", json={**body, "input_ids": [[10, 11], [12, 13]],
                                                   "return_logprob": [True, False]},
                       timeout=60).json()
    assert len(batch[0]["meta_info"]["output_token_logprobs"]) == 4
    assert "output_token_logprobs" not in batch[1]["meta_info"]
    events = httpx.post(server + "/generate", json={**body, "stream": True}, timeout=60).text
    assert "output_ids" in events and "output_token_logprobs" not in events
    wrong = httpx.post(server + "/generate", json={**body, "input_ids": [[10], [11]],
                                                   "return_logprob": [True]}, timeout=60)
    assert wrong.status_code == 400 and "return_logprob" in wrong.text


def test_bad_request_is_a_clear_400(server):
    resp = httpx.post(server + "/generate", json={"sampling_params": {}})
    assert resp.status_code == 400 and "input_ids" in resp.text


def test_logprobs_match_a_full_forward_pass(server, tiny_model_dir):
    prompt = [20, 21, 22, 23]
    out = generate(server, prompt, max_new_tokens=12, temperature=1.0, ignore_eos=True)
    ids = torch.tensor([prompt + out["output_ids"]])
    model = load_model(tiny_model_dir).eval()
    with torch.no_grad():
        ref = sequence_logprobs(model, ids, torch.ones_like(ids), 1.0)[0, len(prompt):]
    got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, ref, atol=1e-4)


def test_continuous_batching_gives_the_same_greedy_outputs(server):
    """Requests that join a running batch at different times (different prompt lengths and
    budgets) decode exactly as they would alone."""
    prompts = [[5 + i] * (3 + 2 * i) for i in range(8)]
    alone = [generate(server, p, max_new_tokens=10 + i, temperature=0.0, ignore_eos=True)["output_ids"]
             for i, p in enumerate(prompts)]

    def staggered(i):
        time.sleep(0.005 * i)
        return generate(server, prompts[i], max_new_tokens=10 + i, temperature=0.0,
                        ignore_eos=True)["output_ids"]

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(staggered, range(8)))
    assert together == alone


def _wait_generating(url: str, min_tokens: int) -> None:
    start = httpx.get(url + "/get_server_info").json()["tokens_generated"]
    deadline = time.time() + 30
    while httpx.get(url + "/get_server_info").json()["tokens_generated"] < start + min_tokens:
        assert time.time() < deadline, "server did not start generating"
        time.sleep(0.005)


def test_pause_aborts_in_flight_with_partial_output_and_continue_resumes(server):
    result = {}
    t = threading.Thread(target=lambda: result.update(
        generate(server, [7, 8, 9], max_new_tokens=400, ignore_eos=True)))
    t.start()
    _wait_generating(server, 10)
    assert httpx.post(server + "/pause_generation", json={"mode": "abort"}).json()["success"]
    t.join(30)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(result["output_ids"]) < 400
    assert len(result["meta_info"]["output_token_logprobs"]) == len(result["output_ids"])

    # While paused, a new request waits; after continue it completes.
    late = {}
    t2 = threading.Thread(target=lambda: late.update(generate(server, [7], max_new_tokens=5,
                                                                ignore_eos=True)))
    t2.start()
    time.sleep(0.5)
    assert not late, "a request must not run while generation is paused"
    httpx.post(server + "/continue_generation")
    t2.join(30)
    assert late["meta_info"]["finish_reason"]["type"] == "length"


def _perturbed_weights(model_dir, out_dir, seed=123):
    from safetensors.torch import save_file

    model = load_model(model_dir)
    g = torch.Generator().manual_seed(seed)
    state = {k: (v + 0.5 * torch.randn(v.shape, generator=g)).contiguous()
             for k, v in model.state_dict().items() if k != "lm_head.weight"}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"))
    return out_dir


def test_weight_update_changes_outputs_and_version(tiny_model_dir, tmp_path):
    from tests.training_core.conftest import start_server

    fleet, url = start_server(tiny_model_dir, tmp_path / "s.log")
    try:
        before = generate(url, [30, 31, 32], max_new_tokens=12, temperature=0.0, ignore_eos=True)
        path = _perturbed_weights(tiny_model_dir, tmp_path / "v1")
        r = httpx.post(url + "/update_weights_from_disk",
                       json={"model_path": str(path), "weight_version": "1"}, timeout=60).json()
        assert r["success"], r
        after = generate(url, [30, 31, 32], max_new_tokens=12, temperature=0.0, ignore_eos=True)
        assert after["output_ids"] != before["output_ids"]
        assert after["meta_info"]["weight_version"] == "1"
        assert httpx.get(url + "/model_info").json()["weight_version"] == "1"
        bad = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(tmp_path)})
        assert bad.status_code == 400 and "safetensors" in bad.text
    finally:
        fleet.stop()


def _three_samples_across_an_update(url: str, weights, **client_kw) -> list:
    """Three 300-token samples of one prompt; a weight update (pause, load, resume) while they
    are generating."""
    async def scenario():
        client = RolloutClient([url], **client_kw)
        task = asyncio.create_task(client.agenerate_group(GenerationRequest(
            [40, 41], SamplingParams(max_new_tokens=300, ignore_eos=True)), 3))
        await asyncio.to_thread(_wait_generating, url, 10)
        await client.pause()
        await client.update_weights_from_disk(str(weights), 1)
        await client.resume()
        resp = await task
        await client.aclose()
        return resp

    return asyncio.run(scenario())


def test_client_resubmits_interrupted_requests_across_versions(tiny_model_dir, tmp_path):
    """A long generation spans a weight update: the client re-submits with the partial output,
    the result has the full length, and each token carries the version that produced it."""
    from tests.training_core.conftest import start_server

    fleet, url = start_server(tiny_model_dir, tmp_path / "s.log")
    try:
        responses = _three_samples_across_an_update(
            url, _perturbed_weights(tiny_model_dir, tmp_path / "v1"))
    finally:
        fleet.stop()
    assert len(responses) == 3
    for resp in responses:
        assert len(resp.output_ids) == 300 and resp.finish_reason == "length"
        assert resp.interruptions >= 1
        assert resp.output_versions[0] == 0 and resp.output_versions[-1] == 1
        assert resp.output_versions == sorted(resp.output_versions)
        assert len(resp.output_logprobs) == 300


def test_in_place_pause_carries_requests_across_a_weight_update(tiny_model_dir, tmp_path):
    """pause_mode in_place over HTTP: the generations in flight are never aborted or sent again;
    they finish whole after the update, each token labelled with the version that made it (the
    server's weight_versions spans, as SGLang 0.5.23 reports them), and the server serves the new
    version."""
    from tests.training_core.conftest import start_server

    fleet, url = start_server(tiny_model_dir, tmp_path / "s.log")
    try:
        responses = _three_samples_across_an_update(
            url, _perturbed_weights(tiny_model_dir, tmp_path / "v1"), pause_mode="in_place")
        after = generate(url, [40, 41], max_new_tokens=2)
    finally:
        fleet.stop()
    for resp in responses:
        assert len(resp.output_ids) == 300 and resp.finish_reason == "length"
        assert resp.interruptions == 0
        before = resp.output_versions.count(0)  # made before the pause, under version 0
        assert 0 < before < 300 and resp.output_versions == [0] * before + [1] * (300 - before)
    assert after["meta_info"]["weight_version"] == "1"


@pytest.mark.parametrize("n_servers", [2])
def test_client_routes_over_several_servers_and_survives_one_dying(tiny_model_dir, tmp_path, n_servers):
    from tests.training_core.conftest import start_server

    fleets = [start_server(tiny_model_dir, tmp_path / f"s{i}.log") for i in range(n_servers)]
    urls = [u for _, u in fleets]

    async def run(n):
        client = RolloutClient(urls, retries=3, cooldown_s=5)
        out = await asyncio.gather(*[client.agenerate(GenerationRequest(
            [50], SamplingParams(max_new_tokens=4, ignore_eos=True))) for _ in range(n)])
        await client.aclose()
        return out

    try:
        asyncio.run(run(8))
        served = [httpx.get(u + "/get_server_info").json()["tokens_generated"] for u in urls]
        assert all(s > 0 for s in served), f"least-in-flight routing used only some servers: {served}"
        fleets[0][0].stop()  # one server dies: requests retry on the other
        out = asyncio.run(run(4))
        assert all(len(r.output_ids) == 4 for r in out)
    finally:
        for f, _ in fleets:
            f.stop()


# ---- SGLang-exact behaviour ------------------------------------------------------------------


def test_request_errors_name_the_field_like_sglang(server):
    def post(sp):
        return httpx.post(server + "/generate", json={"input_ids": [5, 6], "sampling_params": sp})

    unknown = post({"max_new_tokens": 2, "topk": 3})  # SGLang's contract gate, its words
    assert unknown.status_code == 400 and "unknown field `topk`" in unknown.json()["error"]
    assert post({"top_k": 0}).status_code == 400 and "top_k" in post({"top_k": 0}).text
    unsupported = post({"repetition_penalty": 1.3})
    assert unsupported.status_code == 400 and "repetition_penalty" in unsupported.text
    # SGLang's own defaults are accepted.
    assert post({"max_new_tokens": 2, "repetition_penalty": 1.0, "n": 1}).status_code == 200
    bad_type = httpx.post(server + "/generate", json={"input_ids": "abc"})
    assert bad_type.status_code == 400 and "input_ids" in bad_type.text
    mode = httpx.post(server + "/pause_generation", json={"mode": "drain"})
    assert mode.status_code == 400 and "mode" in mode.text


def test_a_request_over_the_context_is_refused_never_trimmed(server):
    """As SGLang 0.5.23 (test_sglang_parity.py has its exact words): a 400, where the embedded
    server used to clamp max_new_tokens and answer, so CPU runs trained on what GPU runs never
    see."""
    def post(n: int, new: int) -> httpx.Response:  # the tiny model holds 512 positions
        return httpx.post(server + "/generate", timeout=60, json={
            "input_ids": [5] * n, "sampling_params": {"max_new_tokens": new, "ignore_eos": True}})

    over = post(600, 4)
    assert over.status_code == 400 and "longer than the model's context length (512" in over.text
    near = post(508, 50)
    assert near.status_code == 400 and "You requested a total of 558 tokens" in near.text
    scheduler = post(508, 4)  # SGLang's scheduler refuses prompts from context - 6 on
    assert scheduler.status_code == 400 and "maximum allowed length (506 tokens)" in scheduler.text
    fits = post(500, 4)
    assert fits.status_code == 200 and len(fits.json()["output_ids"]) == 4


def test_requests_answered_at_once_and_decoded_ones_all_come_back_when_mixed(server):
    """The engine process answers a request it need not queue (no tokens asked) on its reading
    thread while the engine thread answers finished ones: every response arrives, none is lost."""
    def one(i: int) -> dict:
        return generate(server, [5, 6 + i % 7], max_new_tokens=0 if i % 2 else 3, ignore_eos=True)

    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(one, range(64)))
    assert [len(o["output_ids"]) for o in outs] == [0 if i % 2 else 3 for i in range(64)]


def test_health_fails_while_paused_and_model_info_has_the_version(server):
    assert httpx.get(server + "/health").status_code == 200
    assert httpx.get(server + "/model_info").json()["weight_version"] == httpx.get(
        server + "/get_model_info").json()["weight_version"]
    assert httpx.post(server + "/pause_generation", json={"mode": "abort"}).status_code == 200
    try:
        assert httpx.get(server + "/health").status_code == 503
    finally:
        httpx.post(server + "/continue_generation")
    assert httpx.get(server + "/health").status_code == 200
    assert httpx.get(server + "/get_weight_version").status_code == 404  # removed in SGLang


def test_unpaused_weight_update_waits_for_requests_in_flight(tiny_model_dir, tmp_path):
    """SGLang's writer lock: the update waits for the running request, which finishes whole on
    the old weights and says so; requests after it run on the new version."""
    from tests.training_core.conftest import start_server

    fleet, url = start_server(tiny_model_dir, tmp_path / "s.log")
    try:
        path = _perturbed_weights(tiny_model_dir, tmp_path / "v1")
        long = {}
        t = threading.Thread(target=lambda: long.update(
            generate(url, [7, 8, 9], max_new_tokens=300, ignore_eos=True)))
        t.start()
        _wait_generating(url, 5)
        r = httpx.post(url + "/update_weights_from_disk",
                       json={"model_path": str(path), "weight_version": "1"}, timeout=120).json()
        assert r["success"]
        t.join(60)
        assert not t.is_alive() and long, "the update returned before the running request ended"
        assert long["meta_info"]["finish_reason"]["type"] == "length"
        assert len(long["output_ids"]) == 300
        assert long["meta_info"]["weight_version"] == "0"
        after = generate(url, [7, 8, 9], max_new_tokens=3)
        assert after["meta_info"]["weight_version"] == "1"
    finally:
        fleet.stop()


# ---- the engine's own process ------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


def test_the_engine_process_goes_when_its_front_end_is_killed(tiny_model_dir, tmp_path):
    """Generation runs in a child of the HTTP front end; a SIGKILL of the front end alone (no
    handler runs, nothing is closed politely) still leaves no engine process behind."""
    from tests.training_core.conftest import start_server

    fleet, url = start_server(tiny_model_dir, tmp_path / "server.log")
    try:
        front = fleet.servers[0].pid
        engines = _children(front)
        assert len(engines) == 1, f"expected the engine as the front end's only child: {engines}"
        assert len(generate(url, [7, 8], max_new_tokens=3, ignore_eos=True)["output_ids"]) == 3
        os.kill(front, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while Path(f"/proc/{engines[0]}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        state = Path(f"/proc/{engines[0]}/stat")  # an exited child not yet reaped is a zombie
        alive = state.exists() and state.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        assert not alive, "the engine process outlived its front end"
    finally:
        fleet.stop()


def test_a_server_whose_engine_cannot_start_exits_and_says_why(tmp_path):
    from training_core.launch import embedded_server_command

    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.run(embedded_server_command(str(tmp_path / "no-model"), 1, dtype="float32"), stdout=out,
                              stderr=subprocess.STDOUT, timeout=120)
    assert proc.returncode != 0
    assert "the engine failed to start" in log.read_text()


def test_the_server_runs_in_the_runs_dtype(tiny_model_dir, tmp_path):
    """``--dtype bfloat16`` (a run's ``model.dtype``): weights and KV cache in bf16, reported by
    /server_info; its logprobs are an fp32 forward's up to bf16 rounding, not equal to them."""
    from training_core.launch import embedded_server_command, server_process
    from training_core.ports import free_port
    from training_core.processes import Fleet

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = server_process("bf16 server", embedded_server_command(
        str(tiny_model_dir), port, parent_pid=os.getpid(), dtype="bfloat16"), url,
        tmp_path / "server.log", env={**os.environ, "OMP_NUM_THREADS": "1"}).start()
    fleet = Fleet(urls=[url], servers=[proc])
    try:
        fleet.wait_healthy(120)
        info = httpx.get(url + "/server_info").json()
        assert info["dtype"] == "bfloat16"
        assert info["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # where it runs
        prompt = [20, 21, 22, 23]
        out = generate(url, prompt, max_new_tokens=12, temperature=1.0, ignore_eos=True)
    finally:
        fleet.stop()
    ids = torch.tensor([prompt + out["output_ids"]])
    model = load_model(tiny_model_dir).eval()
    with torch.no_grad():
        ref = sequence_logprobs(model, ids, torch.ones_like(ids), 1.0)[0, len(prompt):]
    got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
    gap = (got - ref).abs().max()
    assert 0 < gap < 0.1, f"bf16 logprobs off the fp32 forward by {gap}"
