"""Prepare a run on a trainer node from the tracker's HTTP API, with only the run's ingest token.

GPU-side processes never hold database credentials: the node fetches the resolved spec, the
dataset rows and any user reward code over HTTP, writes them into the run directory and gets a
spec file that ``oolong train --config`` runs, reporting back through the HTTP metrics sink.
"""

from __future__ import annotations

from pathlib import Path

from training_core.config import RunSpec, dump_spec, spec_from_dict
from training_core.rewards.registry import USER_REWARD, USER_REWARD_PACKAGE
from training_core.transport.http import WebClient


def prepare_remote_run(tracker_url: str, token: str, run_dir: str | Path, *,
                       timeout_s: float = 60.0) -> tuple[RunSpec, Path]:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with WebClient.for_run(tracker_url, token, timeout_s=timeout_s) as web:
        info = web.get_json("/api/ingest/run/")
        web.download("/api/ingest/dataset/", run_dir / "dataset.jsonl")
    spec = dict(info["spec"])
    spec["run_dir"] = str(run_dir)
    spec["data"] = {**spec.get("data", {}), "source": f"jsonl:{run_dir / 'dataset.jsonl'}"}
    metrics = dict(spec.get("metrics", {}))
    sinks = list(dict.fromkeys([*metrics.get("sinks", ["jsonl"]), "http"]))
    spec["metrics"] = {**metrics, "sinks": sinks, "tracker_url": tracker_url, "tracker_token": token}
    if info.get("gateway_key"):  # online mode: the key the web app issued and shows its members
        rollout = dict(spec.get("rollout") or {})
        rollout["agent"] = {**(rollout.get("agent") or {}), "gateway_key": info["gateway_key"]}
        spec["rollout"] = rollout
    match = USER_REWARD.match(info["reward"]["fn"])
    if match and info["reward"].get("source"):
        # User reward code becomes an importable module inside the run directory; the trainer's
        # reward workers import it by path (run_dir is put on PYTHONPATH by the launcher).
        pkg = run_dir / USER_REWARD_PACKAGE
        pkg.mkdir(exist_ok=True)
        (pkg / "__init__.py").write_text("")
        (pkg / f"{match.group(1)}.py").write_text(info["reward"]["source"])
    resolved = spec_from_dict(spec)
    path = run_dir / "spec.yaml"
    dump_spec(resolved, path)
    return resolved, path
