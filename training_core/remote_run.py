"""Prepare a run on a trainer node from the tracker's HTTP API, with only the run's ingest token.

GPU-side processes never hold database credentials: the node fetches the resolved spec, the
dataset rows and any user reward code over HTTP, writes them into the run directory and gets a
spec file that ``oolong train --config`` runs, reporting back through the HTTP metrics sink.
"""

from __future__ import annotations

import re
from pathlib import Path

from training_core.config import RunSpec, dump_spec, spec_from_dict
from training_core.rewards.registry import USER_REWARD, USER_REWARD_PACKAGE
from training_core.transport.http import WebClient

EVAL_SETS_DIR = "eval_sets"  # in the run directory: one <name>.jsonl per attached eval set
EVAL_SET_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")


def prepare_remote_run(tracker_url: str, token: str, run_dir: str | Path, *,
                       timeout_s: float = 60.0) -> tuple[RunSpec, Path]:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with WebClient.for_run(tracker_url, token, timeout_s=timeout_s) as web:
        info = web.get_json("/api/ingest/run/")
        web.download("/api/ingest/dataset/", run_dir / "dataset.jsonl")
        # The eval sets attached to the run (dataset versions marked as eval sets), beside it.
        eval_files = {}
        for attached in info.get("eval_sets") or []:
            if not EVAL_SET_NAME.fullmatch(str(attached["name"])):  # a file name, nothing more
                raise ValueError(f"eval set name {attached['name']!r} from the tracker is not "
                                 "a plain name ([a-z0-9_-], at most 40)")
            path = run_dir / EVAL_SETS_DIR / f"{attached['name']}.jsonl"
            path.parent.mkdir(exist_ok=True)
            web.download(f"/api/ingest/eval-sets/{int(attached['dataset_version'])}/", path)
            eval_files[attached["name"]] = path
    spec = dict(info["spec"])
    spec["run_dir"] = str(run_dir)
    spec["data"] = {**spec.get("data", {}), "source": f"jsonl:{run_dir / 'dataset.jsonl'}"}
    if eval_files:  # the web app named them in eval.sets; their rows are here now
        evaluation = dict(spec.get("eval") or {})
        evaluation["sets"] = [
            {**entry, "source": f"jsonl:{eval_files[entry['name']]}"}
            if entry.get("name") in eval_files else entry for entry in evaluation.get("sets") or []]
        spec["eval"] = evaluation
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
