"""End to end on CPU: embedded rollout servers + DeepSpeed trainer + the async loop."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.training_core.conftest import start_server
from training_core import metric_names
from training_core.config import load_spec
from training_core.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]

SMALL = [
    "model.path=tiny", "data.options={max_value: 9}",
    "rollout.max_new_tokens=8", "rollout.max_concurrent=8", "rollout.group_size=4", "trainer.batch_groups=2",
    "trainer.lr=1e-3", "eval.size=4", "reward.executor=process",
    "reward.fn=tests.training_core.rewards_for_tests:digit_reward",
]


class _CheckpointWatch:
    """A sink that notes, when a checkpoint is reported (it is complete by then), which steps
    metrics.jsonl already holds."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.seen = run_dir, {}

    def checkpoint(self, step: int, version: int, path: str) -> None:
        self.seen[step] = [r["step"] for r in read_metrics(self.run_dir)]

    def log(self, *a, **k) -> None: ...
    def event(self, *a, **k) -> None: ...
    def trajectories(self, *a, **k) -> None: ...
    def status(self, *a, **k) -> None: ...
    def undelivered(self) -> list: return []
    def redeliver(self, records) -> None: ...
    def close(self) -> None: ...


def test_async_steps_versions_staleness_and_weights_reach_the_server(tiny_model_dir, tmp_path):
    from training_core.metrics import JsonlSink, MultiSink
    from training_core.train import train

    fleet, url = start_server(tiny_model_dir, tmp_path / "server.log")
    watch = _CheckpointWatch(tmp_path / "run")
    try:
        spec = load_spec(None, SMALL + [
            f"run_dir={tmp_path / 'run'}", f"rollout.server_urls=[{url}]", "trainer.steps=4",
            "rollout.max_staleness=1", "rollout.max_token_staleness=1", "checkpoint.every=2",
            "eval.every=2", "rollout.pause_mode=abort"])  # the distributed test runs in_place
        result = train(spec, progress=False, sink=MultiSink([JsonlSink(tmp_path / "run"), watch]))
        info = httpx.get(url + "/model_info").json()
    finally:
        fleet.stop()
    # A complete checkpoint of step N always has step N's metrics line: a run killed right after
    # it resumes at N + 1 and must not leave a hole (the line used to come after the checkpoint).
    assert set(watch.seen) == {2, 4} and all(step in watch.seen[step] for step in watch.seen)

    rows = read_metrics(result.run_dir)
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["version"] for r in steps] == [1, 2, 3, 4]
    assert all(r["staleness/max"] <= 1 for r in steps)
    # A batch whose 8 rewards are all equal has no advantage, so its gradient is exactly 0 (GRPO):
    # it happened under the full suite's load, where timing gives other samples (step 2: every
    # sample without a digit, reward std 0, grad norm 0). Every other step must train.
    seen = [(r["step"], r["tokens/consumed"], r["grad_norm"], r["reward/std"]) for r in steps]
    assert all(r["tokens/consumed"] > 0 for r in steps), f"(step, tokens, grad norm, std): {seen}"
    assert all(r["grad_norm"] > 0 for r in steps if r["reward/std"] > 0), seen
    assert sum(r["grad_norm"] > 0 for r in steps) >= 2, seen
    # The rollout side of the profile, from the server's counters, measured off the critical
    # path: a step reports the newest finished measurement (one step late, so not the first).
    profiled = [r for r in steps if "rollout/server_busy_frac" in r]
    assert len(profiled) >= len(steps) - 1
    assert all(0 < r["rollout/server_busy_frac"] <= 1 for r in profiled)
    # Prefill is part of the busy time (both read from the same counters over the same interval).
    assert all(0 <= r["rollout/server_prefill_frac"] <= r["rollout/server_busy_frac"]
               for r in profiled)
    assert all(r["rollout/tokens_per_s_per_server"] >= 0 for r in profiled)
    assert any(r["rollout/tokens_per_s_per_server"] > 0 for r in profiled)
    batches = [r["rollout/decode_batch_mean"] for r in profiled if "rollout/decode_batch_mean" in r]
    assert batches and all(1 <= b <= 32 for b in batches)  # 8 groups of 4 (idle intervals: none)
    assert all(r["proximal/recomputed_frac"] == 0 for r in steps)  # one minibatch: own forward
    assert rows[0]["step"] == 0 and "eval/accuracy" in rows[0]
    # Every name the run wrote is declared (training_core.metric_names), so what the charts and
    # the header read (tests/test_metric_names.py) is what a run produces; and the names
    # every step carries whatever the run are all there.
    written = {k for r in rows for k in r} - metric_names.LINE_FIELDS
    assert written <= metric_names.DECLARED, sorted(written - metric_names.DECLARED)
    always = {metric_names.REWARD_MEAN, metric_names.STALENESS_MEAN, metric_names.TOKENS_PER_S,
              metric_names.LOSS, metric_names.VERSION, metric_names.WEIGHT_SYNC_PAUSE_S,
              metric_names.REWARD_ERROR_FRAC, *metric_names.MISMATCH.ALL}
    assert all(always <= r.keys() for r in steps), sorted(always - steps[-1].keys())
    # The last weights reached the server, tagged with their version.
    assert info["weight_version"] == "4"
    assert Path(info["model_path"]).name == "v4"
    assert (result.run_dir / "checkpoints" / "step4" / "COMPLETE").exists()
    assert load_spec(result.run_dir / "spec.yaml").trainer.steps == 4
    kinds = [json.loads(line)["kind"] for line in (result.run_dir / "events.jsonl").open()]
    assert kinds[0] == "started" and kinds[-1] == "finished"


@pytest.mark.slow
def test_distributed_weight_sync_runs_and_resumes_without_a_weights_folder(tiny_model_dir, tmp_path):
    """weight_sync: distributed end to end on two servers: every version reaches both over the
    process group (the servers never load from a path), and a resumed run rebuilds the group
    and pushes the checkpoint's weights before generating. Embedded servers: pause_mode auto is
    in_place, so updates load under paused requests (flush_cache false)."""
    from training_core.train import train

    fleets = [start_server(tiny_model_dir, tmp_path / f"server{i}.log", seed=i) for i in range(2)]
    urls = [url for _, url in fleets]
    run_dir = tmp_path / "run"
    base = SMALL + [f"run_dir={run_dir}", f"rollout.server_urls=[{','.join(urls)}]",
                    "weight_sync=distributed", "checkpoint.every=2", "eval.every=0"]
    try:
        train(load_spec(None, [*base, "trainer.steps=2"]), progress=False)
        first = [httpx.get(u + "/model_info").json() for u in urls]
        train(load_spec(None, [*base, "trainer.steps=3"]), resume_dir=run_dir, progress=False)
        second = [httpx.get(u + "/model_info").json() for u in urls]
    finally:
        for fleet, _ in fleets:
            fleet.stop()

    assert [i["weight_version"] for i in first] == ["2", "2"]
    assert [i["weight_version"] for i in second] == ["3", "3"]
    assert all(i["model_path"] == str(tiny_model_dir) for i in first + second), "no disk loads"
    assert not (run_dir / "weights").exists()
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2, 3]
    assert all(r["time/weight_sync_pause_s"] > 0 for r in rows if r["step"] > 0)
    versions = {v for line in (run_dir / "trajectories.jsonl").open()
                for v in json.loads(line)["token_versions"]}
    assert versions <= {0, 1, 2}, "step 3 trains on samples of versions the servers received"


def _train_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "training_core.cli", "train", "--no-progress", *args]


def _server_pids(trainer_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"rollout_server.server.*--parent-pid {trainer_pid}$"],
                         capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_repeats_and_skips_no_step(tmp_path):
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"name": "resume"}))
    overrides = SMALL + [f"run_dir={run_dir}", "trainer.steps=30", "checkpoint.every=1",
                         "eval.every=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(_train_cmd("--config", str(config), *overrides), cwd=ROOT, env=env,
                            stdout=(tmp_path / "first.log").open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 240
    while True:
        rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        if any(r["step"] >= 3 for r in rows):
            break
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.time() < deadline, "the run did not reach step 3"
        time.sleep(0.1)
    servers = _server_pids(proc.pid)
    assert servers, "the trainer's rollout server should be running"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(r["step"] for r in read_metrics(run_dir))
    assert killed_at < 30

    # Its rollout servers notice and exit: no orphans.
    deadline = time.time() + 15
    while _server_pids(proc.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not _server_pids(proc.pid)

    out = subprocess.run(_train_cmd("--resume", str(run_dir)), cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps == list(range(1, 31)), f"each step exactly once, got {steps}"
    assert [r["version"] for r in read_metrics(run_dir)] == list(range(1, 31))
    events = [json.loads(line) for line in (run_dir / "events.jsonl").open()]
    resumed = [e for e in events if e["kind"] == "resumed"]
    assert resumed and resumed[0]["step"] >= killed_at - 1


@pytest.mark.slow
def test_a_prompt_longer_than_the_context_fails_its_episode_and_the_run_completes(tmp_path):
    """A prompt longer than the context fails its one episode (the client's prompt-length rule
    refuses it before sending; the servers would answer 400), and the run goes on. Once the
    client re-submitted such a prompt forever and the run hung."""
    from training_core.train import train

    data = tmp_path / "data.jsonl"
    rows = [{"question": f"{i}+{i}=", "answer": str(2 * i)} for i in range(1, 40)]
    rows[5] = {"question": "9" * 600, "answer": "9"}  # 600 tokens; the tiny model holds 512
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = load_spec(None, [o for o in SMALL if not o.startswith("data.")] + [
        f"run_dir={tmp_path / 'run'}", f"data.source=jsonl:{data}", "data.eval_size=0",
        "trainer.steps=12", "rollout.max_staleness=1", "checkpoint.every=0", "eval.every=0",
        "rollout.batch_timeout_s=120"])
    result = train(spec, progress=False)
    assert result.last_step == 12
    events = [json.loads(line) for line in (result.run_dir / "events.jsonl").open()]
    failed = [e for e in events if e["kind"] == "episode_failed"]
    assert failed and "max_req_input_len is 506" in failed[0]["message"]
    assert sum(r.get("rollout/episode_errors", 0) for r in read_metrics(result.run_dir)) >= 1


@pytest.mark.slow
def test_stop_and_resume_trains_on_the_same_prompts_as_an_uninterrupted_run(tmp_path):
    """With eta = 0 the prompts of each batch are fixed, so stop + resume must train on exactly
    the uninterrupted run's prompts. Before the fix, the prompts in flight at the checkpoint
    were skipped on resume (the loader position counted them as used)."""
    from training_core.metrics import read_batch_log
    from training_core.train import train

    common = SMALL + ["rollout.max_staleness=0", "checkpoint.every=1", "eval.every=0"]
    whole = train(load_spec(None, common + [f"run_dir={tmp_path / 'whole'}", "trainer.steps=6"]),
                  progress=False)
    part = tmp_path / "part"
    train(load_spec(None, common + [f"run_dir={part}", "trainer.steps=3"]), progress=False)
    resumed = train(load_spec(None, common + [f"run_dir={part}", "trainer.steps=6"]),
                    resume_dir=part, progress=False)
    assert resumed.last_step == 6

    def prompts(run_dir):
        log = read_batch_log(run_dir)
        assert [b["step"] for b in log] == list(range(1, 7))
        return sorted(p for b in log for p in b["prompts"])

    assert prompts(part) == prompts(whole.run_dir) == list(range(6 * 2))
    # The checkpoint at step 3 is taken right after the version bump: batch 4's prompts are
    # handed out then or a moment later, so 2 or 0 are requeued; either way none is skipped.
    # (test_rollout_executor checks the requeue itself deterministically.)
    events = [json.loads(line) for line in (part / "events.jsonl").open()]
    assert [e["requeued_prompts"] for e in events if e["kind"] == "resumed"] in ([0], [2])


@pytest.mark.slow
class _RecordingTracker(http.server.ThreadingHTTPServer):
    """A tracker that stores the metric steps it is posted (the ingest API's shape)."""

    def __init__(self) -> None:
        self.steps: set[int] = set()
        tracker = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/api/ingest/metrics/":
                    tracker.steps.update(p["step"] for p in body["points"])
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *a) -> None: ...

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_resume_on_fresh_nodes_from_the_durable_checkpoint_store(tmp_path, monkeypatch):
    """Node A trains and uploads its checkpoints; node A is gone (its run directory never seen
    again); node B starts with an empty run directory of the same run and resumes from the
    store. The tracker was unreachable while node A lived, so every metric it logged was still
    in its spool: the checkpoint carried them, and node B delivers them (no step missing)."""
    from training_core.checkpoint_store import STORE_ENV
    from training_core.metrics import JsonlSink, MultiSink
    from training_core.ports import free_port
    from training_core.tracking_sink import HttpSink
    from training_core.train import train

    store = tmp_path / "store"
    monkeypatch.setenv(STORE_ENV, f"file://{store}")
    common = SMALL + ["checkpoint.every=2", "checkpoint.keep=1", "eval.every=0"]
    node_a = tmp_path / "node-a" / "run-7"
    unreachable = HttpSink(f"http://127.0.0.1:{free_port()}", "token", spool_dir=node_a / "spool",
                           flush_interval_s=0.05, close_timeout_s=0.5)
    train(load_spec(None, common + [f"run_dir={node_a}", "trainer.steps=4"]), progress=False,
          sink=MultiSink([JsonlSink(node_a), unreachable]))
    assert unreachable.pending() > 0, "node A delivered nothing"
    stored = sorted(p.name for p in (store / "run-7" / "checkpoints").iterdir())
    assert stored == ["step4"], "uploaded, and pruned to checkpoint.keep"
    assert (store / "run-7" / "checkpoints" / "step4" / "COMPLETE").exists()

    node_b = tmp_path / "node-b" / "run-7"
    node_b.mkdir(parents=True)
    tracker = _RecordingTracker()
    try:
        result = train(load_spec(None, common + [
            f"run_dir={node_b}", "trainer.steps=5", "metrics.sinks=[jsonl, http]",
            f"metrics.tracker_url=http://127.0.0.1:{tracker.server_address[1]}",
            "metrics.tracker_token=token"]), resume_dir=node_b, progress=False)
    finally:
        tracker.shutdown()
    assert tracker.steps == {1, 2, 3, 4, 5}, "node A's undelivered steps came with its checkpoint"
    assert result.last_step == 5 and result.final_version == 5
    events = [json.loads(line) for line in (node_b / "events.jsonl").open()]
    resumed = [e for e in events if e["kind"] == "resumed"]
    assert resumed and resumed[0]["step"] == 4 and "step4" in resumed[0]["message"]
    assert [r["step"] for r in read_metrics(node_b) if r["step"] > 0] == [5]
